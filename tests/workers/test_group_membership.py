"""On the real broker: a member whose heartbeats stall past the session timeout is expelled by the group
coordinator; the consumer notices, reports it, releases its partitions (`lost`) and joins again."""

from __future__ import annotations

import time
import uuid

import pytest
from kafka import KafkaProducer

from workers.kafka_io import GroupConsumer, group_members
from workers.kafka_io.consumer import SESSION_TIMEOUT_MS
from workers.services.kafka import ensure_topics

pytestmark = [pytest.mark.services, pytest.mark.slow, pytest.mark.timeout(180)]


def _poll_until(reader: GroupConsumer, done, timeout_s: float) -> list:
    events, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reader.poll(0.2)
        events += reader.rebalances()
        if done(events):
            return events
    raise AssertionError(f"timed out; rebalance events so far: {events}")


def _stall_heartbeats(reader: GroupConsumer) -> None:
    """What a dead or stuck heartbeat loop looks like from the broker: no heartbeat arrives any more."""
    reader._consumer._coordinator._disable_heartbeat()


def test_an_expelled_member_notices_releases_and_rejoins(settings):
    prefix = f"t{uuid.uuid4().hex[:10]}"
    topic, group = f"{prefix}.jobs", f"{prefix}-group"
    ensure_topics(settings.kafka_connection, {topic: 2})
    reader = GroupConsumer(settings.kafka_connection, group, [topic], "inferq-test")
    try:
        _poll_until(reader, lambda ev: any(e.kind == "assigned" and e.partitions for e in ev), 60)
        assert reader.membership().member and reader.membership().losses == 0

        _stall_heartbeats(reader)
        # the coordinator expels the member once a session passes without a heartbeat; until then it polls on
        deadline = time.monotonic() + SESSION_TIMEOUT_MS / 1000 + 30
        while group_members(settings.kafka_connection, group) and time.monotonic() < deadline:
            reader.poll(0.2)
            time.sleep(0.5)
        assert group_members(settings.kafka_connection, group) == 0, "the broker never expelled the member"

        events = _poll_until(reader, lambda ev: any(e.kind == "assigned" and e.partitions for e in ev), 60)
        kinds = [e.kind for e in events if e.partitions]
        assert kinds.index("lost") < kinds.index("assigned"), kinds  # released before it took them back
        membership = reader.membership()
        assert membership.member and membership.losses == 1, membership
        assert group_members(settings.kafka_connection, group) == 1

        producer = KafkaProducer(bootstrap_servers=settings.kafka)
        try:
            producer.send(topic, key=b"k", value=b"after").get(30)
        finally:
            producer.close()
        deadline, got = time.monotonic() + 30, []
        while not got and time.monotonic() < deadline:
            got = reader.poll(0.5)
        assert [r.value for r in got] == [b"after"]
    finally:
        reader.close()
