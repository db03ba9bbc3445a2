"""A topic that appears on the real broker only when the test says so, and a real producer that counts
its metadata waits that timed out: for `Producer.await_topic` and the relay that relies on it.

The local broker creates a missing topic as soon as a client asks for its metadata (auto-creation), so
the topic is held back by another one whose name differs only by '.' against '_': Kafka refuses a name
that collides with an existing topic's, auto-created ones included, and its metadata stays unknown.
Deleting the blocker lets the next metadata request create it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator

from kafka.admin import KafkaAdminClient
from kafka.errors import KafkaTimeoutError

from workers.kafka_io import Producer
from workers.kafka_io.admin import delete_topics
from workers.settings import Settings


@contextlib.contextmanager
def late_topic(settings: Settings) -> Iterator[tuple[str, Callable[[], None]]]:
    """(topic, release): the topic cannot exist until release() deletes its blocker; both deleted after."""
    prefix = f"late{uuid.uuid4().hex[:10]}"
    topic, blocker = f"{prefix}.events", f"{prefix}_events"
    spec = {"num_partitions": 1, "replication_factor": 1}
    with KafkaAdminClient(bootstrap_servers=settings.kafka) as admin:
        admin.create_topics({blocker: spec}, wait_for_metadata=True)

    def release() -> None:
        with KafkaAdminClient(bootstrap_servers=settings.kafka) as admin:
            admin.delete_topics([blocker])

    try:
        yield topic, release
    finally:
        delete_topics(settings.kafka_connection, prefix)


class CountingProducer(Producer):
    """The real producer; `misses` counts the metadata look-ups that timed out (each waits max_block_s)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.misses = 0
        client = self._producer
        ask = client.partitions_for

        def counted(topic: str):
            try:
                return ask(topic)
            except KafkaTimeoutError:
                self.misses += 1
                raise

        client.partitions_for = counted
