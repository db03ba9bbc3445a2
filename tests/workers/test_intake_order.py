"""On the real broker: records of `first` topics are handed out ahead of a backlog already buffered from
another topic (kafka-python alone hands out the whole buffered backlog first)."""

from __future__ import annotations

import time
import uuid

import pytest
from kafka import KafkaProducer

from workers.kafka_io import GroupConsumer, Record
from workers.services.kafka import ensure_topics

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]

BACKLOG = 300


def _send(settings, topic: str, count: int) -> None:
    producer = KafkaProducer(bootstrap_servers=settings.kafka, linger_ms=50)
    try:
        for i in range(count):
            producer.send(topic, key=b"k", value=f"{topic}-{i}".encode())
        producer.flush(60)
    finally:
        producer.close()


def _backlogged_reader(settings, first):
    """A group member of two fresh topics with the backlog topic's records buffered, one record read."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    backlog, urgent = f"{prefix}.backlog", f"{prefix}.urgent"
    ensure_topics(settings.kafka_connection, {backlog: 1, urgent: 1})
    _send(settings, backlog, BACKLOG)
    reader = GroupConsumer(settings.kafka_connection, f"{prefix}-group", [backlog, urgent], "inferq-test")
    deadline = time.monotonic() + 60
    got: list[Record] = []
    while not got and time.monotonic() < deadline:
        got = reader.poll(0.5, 1, first)
    assert got and got[0].source[0] == backlog
    return reader, backlog, urgent


def _backlog_read_before_urgent(settings, reader, urgent: str, first) -> int:
    _send(settings, urgent, 1)
    read, deadline = 1, time.monotonic() + 60
    while time.monotonic() < deadline:
        for record in reader.poll(0.5, 1, first):
            if record.source[0] == urgent:
                return read
            read += 1
        time.sleep(0.002)  # a worker polls again once it has room: a few steps, never zero time
    raise AssertionError("the urgent record never came")


def _is_urgent(topic: str) -> bool:
    return topic.endswith(".urgent")


def _read_ahead_of_urgent(settings, first) -> int:
    """Backlog records handed out before a record of the urgent topic posted after them."""
    reader, _backlog, urgent = _backlogged_reader(settings, first)
    try:
        return _backlog_read_before_urgent(settings, reader, urgent, first)
    finally:
        reader.close()


def test_records_of_first_topics_pass_a_buffered_backlog(settings):
    ahead = _read_ahead_of_urgent(settings, _is_urgent)
    assert ahead < BACKLOG // 10, ahead


def test_without_first_the_backlog_is_read_before_anything_else(settings):
    # the behaviour `first` exists for (kafka-python 3.0 hands out all 300): if this fails, it may be moot
    ahead = _read_ahead_of_urgent(settings, None)
    assert ahead >= BACKLOG // 2, ahead
