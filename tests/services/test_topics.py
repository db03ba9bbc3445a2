"""`ensure_topics` against the shared broker: topics are created, and an existing topic with fewer
partitions than configured is left alone (growing it moves keys) unless growing is asked for. Scratch
topics under a unique prefix only, deleted afterwards."""

from __future__ import annotations

import uuid

import pytest
from kafka.admin import KafkaAdminClient

from workers.cli import build_parser
from workers.kafka_io.admin import delete_topics, ensure_topics
from workers.settings import Settings

pytestmark = pytest.mark.services


def _partitions(settings: Settings, topic: str) -> int:
    with KafkaAdminClient(bootstrap_servers=settings.kafka) as admin:
        [found] = admin.describe_topics([topic])
    return len(found["partitions"])


def test_an_under_partitioned_topic_is_reported_not_grown_unless_asked(settings: Settings) -> None:
    prefix = f"grow{uuid.uuid4().hex[:10]}"
    topic, conn = f"{prefix}.results", settings.kafka_connection
    try:
        assert ensure_topics(conn, {topic: 2}) == [f"created {topic} (2 partitions)"]
        [warning] = ensure_topics(conn, {topic: 4})
        assert warning.startswith(f"warning: {topic} has 2 partitions, 4 configured")
        assert "--grow-partitions" in warning
        assert _partitions(settings, topic) == 2  # keys stay where they are
        assert ensure_topics(conn, {topic: 4}, grow=True) == [f"grew {topic} from 2 to 4 partitions"]
        assert _partitions(settings, topic) == 4
        assert ensure_topics(conn, {topic: 4}) == []  # as configured: nothing to say
        assert ensure_topics(conn, {topic: 3}) == []  # more than configured is never shrunk or reported
    finally:
        delete_topics(conn, prefix)


def test_up_grows_partitions_only_with_its_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["up"]).grow_partitions is False
    assert parser.parse_args(["up", "--grow-partitions"]).grow_partitions is True
