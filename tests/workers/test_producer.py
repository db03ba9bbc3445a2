"""The producer against the real broker: a message larger than its topic takes must not break the client
for the messages after it (kafka-python's idempotent producer fails every later message once the broker
refused one for good). Scratch topics under a unique prefix, deleted afterwards."""

from __future__ import annotations

import uuid

import pytest
from kafka.admin import KafkaAdminClient
from kafka.errors import MessageSizeTooLargeError

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
