"""On the real broker: the intake thread takes up the loop's resume of a held topic within a short wait,
not after its poll timeout (a worker that paused its jobs at the cap would otherwise sit idle that long
once its backlog drained: a burst of short jobs had 1-3 such stalls of the whole 0.2 s poll)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from kafka import KafkaProducer

from workers.kafka_io import BroadcastReader, GroupConsumer
from workers.services.kafka import ensure_topics
from workers.serving.intake.thread import IntakeThread

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]

LONG_POLL_S = 30.0  # a poll timeout far past the test's wait: only a short poll lets the resume through


def test_a_resume_is_taken_up_while_a_long_poll_would_still_wait(settings):
    topic = f"t{uuid.uuid4().hex[:10]}.held"
    control = f"{topic}.control"
    ensure_topics(settings.kafka_connection, {topic: 1, control: 1})
    conn = settings.kafka_connection
    consumer = GroupConsumer(conn, f"{topic}-group", [topic], "inferq-test")
    intake = IntakeThread(consumer, BroadcastReader(conn, control, "inferq-test-control"), threading.Event(),
                          poll_s=LONG_POLL_S)  # fmt: skip
    intake.room = 100
    consumer.pause([topic])  # held from the start: the thread's first poll sees it held
    intake.start()
    producer = KafkaProducer(bootstrap_servers=settings.kafka)
    try:
        deadline = time.monotonic() + 60
        while not intake.assignment and time.monotonic() < deadline:
            time.sleep(0.1)
        assert intake.assignment, "the member never got its partition"
        for i in range(5):
            producer.send(topic, value=f"job-{i}".encode())
        producer.flush(30)
        time.sleep(1.0)
        assert intake.records() == []  # held: nothing read
        intake.request(lambda c: c.resume([topic]))
        got: list = []
        deadline = time.monotonic() + LONG_POLL_S / 3
        while len(got) < 5 and time.monotonic() < deadline:
            got += intake.records()
            time.sleep(0.05)
        assert sorted(r.value for r, _ in got) == [f"job-{i}".encode() for i in range(5)]
    finally:
        producer.send(topic, value=b"wake")  # ends the thread's long poll: it stops at once
        producer.close()
        intake.stop(timeout_s=LONG_POLL_S + 5)
        consumer.close()
