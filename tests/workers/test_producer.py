"""The producer against the real broker: a message larger than its topic takes must not break the client
for the messages after it (kafka-python's idempotent producer fails every later message once the broker
refused one for good); `await_topic` waits past a send's block for a topic that appears meanwhile, and
gives up at its bound on one that does not. Scratch topics under a unique prefix, deleted afterwards."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from kafka.admin import KafkaAdminClient
from kafka.errors import MessageSizeTooLargeError

from tests.workers.late_topics import CountingProducer, late_topic
from tests.workers.worker_factories import now_ms, read_topic, wait_until
from workers.kafka_io import Producer
from workers.kafka_io.admin import delete_topics
from workers.settings import Settings

pytestmark = pytest.mark.services


@pytest.fixture
def small_topic(settings: Settings):
    """A topic that takes record batches of at most 2,000 bytes."""
    prefix = f"small{uuid.uuid4().hex[:10]}"
    topic = f"{prefix}.results"
    with KafkaAdminClient(bootstrap_servers=settings.kafka) as admin:
        spec = {"num_partitions": 1, "replication_factor": 1, "configs": {"max.message.bytes": "2000"}}
        admin.create_topics({topic: spec}, wait_for_metadata=True)
    try:
        yield settings.kafka_connection, topic
    finally:
        delete_topics(settings.kafka_connection, prefix)


def test_a_message_larger_than_its_topic_takes_is_refused_before_it_is_sent(small_topic):
    conn, topic = small_topic
    producer = Producer(conn, "inferq-test-sizes", check_sizes=True)
    try:
        with pytest.raises(MessageSizeTooLargeError, match="max.message.bytes 2000"):
            producer.send(topic, "job-1", b"x" * 5000)
        producer.send(topic, "job-1", b"x" * 1500, [("job_id", b"job-1")]).wait(30)  # fits: it goes
    finally:
        producer.close()


def test_a_client_broken_by_a_refused_message_is_replaced_for_the_next_one(small_topic):
    conn, topic = small_topic
    producer = Producer(conn, "inferq-test-sizes")  # no check: the broker refuses it
    try:
        with pytest.raises(MessageSizeTooLargeError):
            producer.send(topic, "job-1", b"x" * 5000).wait(30)
        producer.send(topic, "job-2", b"small").wait(30)
    finally:
        producer.close()


def test_await_topic_waits_past_the_send_block_for_a_topic_that_appears_meanwhile(settings):
    """The relay's first event to a topic: its metadata may take longer than a send's 0.5 s block."""
    with late_topic(settings) as (topic, release):
        producer = CountingProducer(settings.kafka_connection, "inferq-test-await", max_block_s=0.5)
        try:
            known: list[bool] = []
            waiter = threading.Thread(target=lambda: known.append(producer.await_topic(topic, 120)))
            waiter.start()
            # two look-ups of a send's block each have timed out, and it still waits
            wait_until(lambda: producer.misses >= 2 or not waiter.is_alive(), timeout_s=60)
            assert waiter.is_alive(), f"await_topic gave up after {producer.misses} look-up(s): {known}"
            since = now_ms()
            release()
            waiter.join(120)
            assert known == [True]
            producer.send(topic, "job-1", b"first").wait(30)  # the send that waited for it goes out
            misses = producer.misses
            assert producer.await_topic(topic, 0.0) and producer.misses == misses  # known now: no wait
        finally:
            producer.close()
        records = read_topic(settings, topic, since, lambda rs: len(rs) >= 1)
        assert [(r.key, r.value) for r in records] == [(b"job-1", b"first")]


def test_await_topic_gives_up_at_its_bound_on_a_topic_that_never_appears(settings):
    with late_topic(settings) as (topic, _):
        producer = CountingProducer(settings.kafka_connection, "inferq-test-await", max_block_s=0.5)
        try:
            known: list[bool] = []
            waiter = threading.Thread(target=lambda: known.append(producer.await_topic(topic, 3.0)))
            started = time.monotonic()
            waiter.start()
            waiter.join(120)  # a 3 s bound: far sooner, unless the bound is not kept
            assert not waiter.is_alive(), "await_topic did not return at its bound"
            waited = time.monotonic() - started
        finally:
            producer.close()
    assert known == [False]
    assert producer.misses >= 2 and waited >= 3.0  # it asked again until the bound, not just once
