"""On the real broker: a held topic's partitions stay paused whenever they are assigned; a partition the
client has stopped fetching (its state left wrong inside kafka-python) is noticed and read again; one that
is merely paused, or caught up, is left alone."""

from __future__ import annotations

import time
import uuid

import pytest
from kafka import KafkaProducer, TopicPartition

from workers.kafka_io import GroupConsumer
from workers.kafka_io.stalls import StallWatch
from workers.services.kafka import ensure_topics

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]

PER_PARTITION = 40


@pytest.fixture
def member(settings):
    """(reader, topic): a member of a fresh two-partition topic holding PER_PARTITION records in each, with
    a watchdog that acts after 1 s and 3 short polls."""
    topic = f"t{uuid.uuid4().hex[:10]}.stall"
    ensure_topics(settings.kafka_connection, {topic: 2})
    producer = KafkaProducer(bootstrap_servers=settings.kafka)
    try:
        for partition in (0, 1):
            for i in range(PER_PARTITION):
                producer.send(topic, value=f"{partition}-{i}".encode(), partition=partition)
        producer.flush(60)
    finally:
        producer.close()
    reader = GroupConsumer(settings.kafka_connection, f"{topic}-group", [topic], "inferq-test")
    reader.stalls = StallWatch(reader._consumer, stall_s=1.0, polls=3)
    yield reader, topic
    reader.close()


def _read(
    reader: GroupConsumer, want: int, within_s: float, got: dict[int, set[int]] | None = None
) -> dict[int, set[int]]:
    got = got if got is not None else {0: set(), 1: set()}
    deadline = time.monotonic() + within_s
    while sum(map(len, got.values())) < want and time.monotonic() < deadline:
        for record in reader.poll(0.1, 8):
            got[record.source[1]].add(record.offset)
    return got


def _read_all(reader: GroupConsumer, got: dict[int, set[int]] | None = None) -> None:
    """Every record of both partitions comes (within 30 s), with what `got` already holds."""
    got = _read(reader, 2 * PER_PARTITION, within_s=30, got=got)
    assert got == {0: set(range(PER_PARTITION)), 1: set(range(PER_PARTITION))}, got


def _wait_assigned(reader: GroupConsumer, topic: str) -> dict[int, set[int]]:
    """Polls (one record at a time) until both partitions are assigned; what those polls read."""
    got: dict[int, set[int]] = {0: set(), 1: set()}
    deadline = time.monotonic() + 60
    while len(reader.assignment()) < 2 and time.monotonic() < deadline:
        for record in reader.poll(0.2, 1):
            got[record.source[1]].add(record.offset)
    assert reader.assignment() == {(topic, 0), (topic, 1)}
    return got


def test_a_partition_left_unfetchable_is_read_again(member):
    reader, topic = member
    got = _wait_assigned(reader, topic)
    # the state a revocation leaves while its callback runs; left behind, nothing fetches it again
    reader._consumer._subscription.assignment[TopicPartition(topic, 1)].mark_pending_revocation()
    _read_all(reader, got)
    assert reader.stalls.healed == 1


def test_paused_and_caught_up_partitions_are_left_alone(member):
    reader, topic = member
    got = _wait_assigned(reader, topic)
    reader.pause([topic])  # pause() takes topics: both partitions wait, on purpose
    assert _read(reader, 1, within_s=3) == {0: set(), 1: set()}
    reader.resume([topic])
    _read_all(reader, got)
    _read(reader, 1, within_s=3)  # caught up: short polls, nothing waiting
    assert reader.stalls.healed == 0


def test_a_topic_held_before_its_partitions_are_assigned_is_not_read_until_released(member):
    # the worker pauses a class's topics whenever enough jobs wait, also before (or while) a rebalance
    # hands it partitions: those must start paused, and a release must reach every one of them
    reader, topic = member
    reader.pause([topic])
    deadline = time.monotonic() + 60
    while len(reader.assignment()) < 2 and time.monotonic() < deadline:
        assert reader.poll(0.2, 8) == []
    assert _read(reader, 1, within_s=2) == {0: set(), 1: set()}
    reader.resume([topic])
    _read_all(reader)
