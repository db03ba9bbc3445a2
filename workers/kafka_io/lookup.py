"""Which keys already have a message in a topic: the check that makes a resend safe.

A producer's future can fail although the broker wrote the message (its acknowledgement was lost with a
broker that died, or a batch expired on its way), and an idempotent producer cannot recognise a later
copy as the same message. So before a result is sent again, the worker reads its key's partition from a
point in time to the end, and sends it again only if no message with that key is there.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaTimeoutError

from workers.kafka_io.records import partition_for_key
from workers.settings import KafkaConnection


class KeyLookup:
    """Reads partitions outside any group; one client, created at the first lookup and reused."""

    def __init__(self, conn: KafkaConnection, client_id: str, timeout_s: float = 30.0) -> None:
        self._conn = conn
        self._client_id = client_id
        self._timeout_s = timeout_s
        self._consumer: KafkaConsumer | None = None

    def present(self, topic: str, since_ms: Mapping[str, int]) -> set[str]:
        """The keys of `since_ms` with a message in `topic` at or after their time (Kafka timestamps).

        Raises (a transient Kafka error, or KafkaTimeoutError past `timeout_s`) when the broker cannot
        say; the caller must then neither resend nor assume delivery.
        """
        if not since_ms:
            return set()
        consumer = self._client()
        deadline = time.monotonic() + self._timeout_s
        parts = sorted(consumer.partitions_for_topic(topic) or ())
        if not parts:
            raise KafkaTimeoutError(f"no partitions known for {topic}")
        wanted: dict[TopicPartition, dict[bytes, int]] = {}
        for key, since in since_ms.items():
            tp = TopicPartition(topic, parts[partition_for_key(key, len(parts))])
            wanted.setdefault(tp, {})[key.encode()] = since
        consumer.assign(list(wanted))
        ends = consumer.end_offsets(list(wanted))  # what is there now: read up to here, no further
        starts = consumer.offsets_for_times({tp: min(keys.values()) for tp, keys in wanted.items()})
        unread = set()
        for tp in wanted:
            start = starts.get(tp)
            if start is not None and start.offset < ends[tp]:
                consumer.seek(tp, start.offset)
                unread.add(tp)
        found: set[str] = set()
        while unread:
            if time.monotonic() > deadline:
                raise KafkaTimeoutError(f"{len(since_ms)} keys in {topic}: no answer in {self._timeout_s}s")
            for tp, records in consumer.poll(timeout_ms=500).items():
                for r in records:
                    since = wanted[tp].get(r.key)
                    if since is not None and r.timestamp >= since:
                        found.add(r.key.decode())
            unread = {tp for tp in unread if consumer.position(tp) < ends[tp]}
        return found

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close(autocommit=False)
            self._consumer = None

    def _client(self) -> KafkaConsumer:
        if self._consumer is None:
            self._consumer = KafkaConsumer(
                **self._conn.client_options(), client_id=self._client_id, enable_auto_commit=False
            )
        return self._consumer
