"""Which keys already have a message in a topic: the check that makes a resend safe.

A producer's future can fail although the broker wrote the message (its acknowledgement was lost with a
broker that died, or a batch expired on its way), and an idempotent producer cannot recognise a later
copy as the same message. So before a result is sent again, the worker reads its key's partition from a
point in time to the end, and sends it again only if that exact message (same key, same bytes) is not there.
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

    def __init__(self, conn: KafkaConnection, client_id: str, timeout_s: float = 10.0) -> None:
        self._conn = conn
        self._client_id = client_id
        self._timeout_s = timeout_s
        self._consumer: KafkaConsumer | None = None

    def present(self, topic: str, wanted: Mapping[str, tuple[int, bytes]]) -> set[str]:
        """The keys of `wanted` (key -> (since_ms, value)) whose exact value is in `topic` at or after
        their time (Kafka timestamps). Only the same bytes count: another tenant's message under the same
        key (its job of the same job_id) is not this one.

        Raises when the broker cannot say within about `timeout_s` (each call to it is bounded); the
        caller must then neither resend nor assume delivery.
        """
        if not wanted:
            return set()
        consumer = self._client()
        deadline = time.monotonic() + self._timeout_s

        def left_ms() -> int:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KafkaTimeoutError(f"{len(wanted)} keys in {topic}: no answer in {self._timeout_s}s")
            return int(left * 1000)

        parts = sorted(consumer.partitions_for_topic(topic) or ())
        if not parts:
            raise KafkaTimeoutError(f"no partitions known for {topic}")
        by_tp: dict[TopicPartition, dict[bytes, tuple[int, bytes]]] = {}
        for key, (since, value) in wanted.items():
            tp = TopicPartition(topic, parts[partition_for_key(key, len(parts))])
            by_tp.setdefault(tp, {})[key.encode()] = (since, value)
        consumer.assign(list(by_tp))
        ends = consumer.end_offsets(list(by_tp), timeout_ms=left_ms())  # read up to here, no further
        times = {tp: min(since for since, _ in keys.values()) for tp, keys in by_tp.items()}
        starts = consumer.offsets_for_times(times, timeout_ms=left_ms())
        unread = set()
        for tp in by_tp:
            start = starts.get(tp)
            if start is not None and start.offset < ends[tp]:
                consumer.seek(tp, start.offset)
                unread.add(tp)
        found: set[str] = set()
        while unread:
            for tp, records in consumer.poll(timeout_ms=min(500, left_ms())).items():
                for r in records:
                    since, value = by_tp[tp].get(r.key, (None, None))
                    if since is not None and r.timestamp >= since and r.value == value:
                        found.add(r.key.decode())
            unread = {tp for tp in unread if consumer.position(tp, timeout_ms=left_ms()) < ends[tp]}
        return found

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close(autocommit=False)
            self._consumer = None

    def _client(self) -> KafkaConsumer:
        if self._consumer is None:
            ms = int(self._timeout_s * 1000)
            self._consumer = KafkaConsumer(
                **self._conn.client_options(),
                client_id=self._client_id,
                enable_auto_commit=False,
                auto_offset_reset="earliest",  # a start offset deleted meanwhile: read on from the oldest
                request_timeout_ms=ms,
            )
        return self._consumer
