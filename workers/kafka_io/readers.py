"""Readers outside any consumer group: every worker's view of control, and per-job views of a topic."""

from __future__ import annotations

import re
from collections.abc import Iterable

from kafka import KafkaConsumer, TopicPartition

from workers.kafka_io.batches import guard, recover
from workers.kafka_io.codec import DEFAULT_MAX_DECOMPRESSED
from workers.kafka_io.records import Partition, Record, partition_for_key, to_record
from workers.settings import KafkaConnection


class BroadcastReader:
    """Reads every partition of a topic from its end, outside any group: every worker sees every message.

    A batch it cannot decode comes up once as one undecodable `Record` spanning the batch (the group member
    that owns the partition dead-letters it), and reading goes on after it; no error stops the reader.
    Given a regex, it reads the topics that match when it starts (a topic made later is not read here:
    its group reader still handles every message of it durably).
    """

    def __init__(
        self,
        conn: KafkaConnection,
        topic: str | re.Pattern[str],
        client_id: str,
        max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED,
    ) -> None:
        self._consumer = KafkaConsumer(**conn.client_options(), client_id=client_id, enable_auto_commit=False)
        guard(self._consumer, max_decompressed_bytes)
        if isinstance(topic, str):
            names = [topic]
        else:
            names = sorted(t for t in self._consumer.topics() if topic.fullmatch(t))
        tps = [
            TopicPartition(name, p)
            for name in names
            for p in sorted(self._consumer.partitions_for_topic(name) or {0})
        ]
        self._idle = not tps  # nothing to read (no tenant yet)
        if self._idle:
            return
        self._consumer.assign(tps)
        self._consumer.seek_to_end(*tps)
        for tp in tps:  # resolve the end now: a message written after the reader exists is read
            self._consumer.position(tp, timeout_ms=10_000)

    def poll(self, timeout_s: float = 0.0) -> list[Record]:
        if self._idle:
            return []
        try:
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000))
        except Exception as exc:  # noqa: BLE001 - a broker hiccup or a bad batch must not stop the worker
            return recover(self._consumer, exc, "control reader")
        return [to_record(r) for records in batches.values() for r in records]

    def close(self) -> None:
        self._consumer.close(autocommit=False)


class TopicReader:
    """Reads a topic from a point in time, outside any group; with `key`, only that key's records.

    Used by `tail`, `submit --stream/--wait` and the demo. `since_ms=None` starts at the end.
    """

    def __init__(
        self, conn: KafkaConnection, topic: str, since_ms: int | None, client_id: str, key: str | None = None
    ) -> None:
        self.key = key.encode() if key is not None else None
        self._consumer = KafkaConsumer(**conn.client_options(), client_id=client_id, enable_auto_commit=False)
        parts = sorted(self._consumer.partitions_for_topic(topic) or {0})
        if key is not None:
            parts = [parts[partition_for_key(key, len(parts))]]
        tps = [TopicPartition(topic, p) for p in parts]
        self._consumer.assign(tps)
        found = self._consumer.offsets_for_times({tp: since_ms for tp in tps}) if since_ms is not None else {}
        for tp in tps:
            if found.get(tp) is not None:
                self._consumer.seek(tp, found[tp].offset)
            else:
                self._consumer.seek_to_end(tp)
                self._consumer.position(tp)  # resolve the end now, before anyone writes after it

    def poll(self, timeout_s: float) -> list[Record]:
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000))
        records = (r for rs in batches.values() for r in rs)
        return [to_record(r) for r in records if self.key is None or r.key == self.key]

    def close(self) -> None:
        self._consumer.close(autocommit=False)


class PartitionReader:
    """Reads the partitions it is told to, outside any group, and moves them by time or offset.

    Every call is bounded: partitions are named by the caller (no waiting for topic metadata), look-ups
    time out after `timeout_s`. One thread only (the client library's consumer is not thread-safe).
    """

    def __init__(
        self, conn: KafkaConnection, client_id: str, timeout_s: float, fetch_max_wait_s: float = 0.5
    ) -> None:
        """`fetch_max_wait_s`: how long the broker holds a fetch that has nothing new. One fetch per broker
        is in flight at a time, so a partition assigned (or moved) meanwhile is first read when it returns:
        a short wait makes a newly followed job's records come sooner, for a fetch that often when idle."""
        ms = max(1000, int(timeout_s * 1000))
        self._timeout_ms = ms
        self._consumer = KafkaConsumer(
            **conn.client_options(),
            client_id=client_id,
            enable_auto_commit=False,
            bootstrap_timeout_ms=ms,
            request_timeout_ms=ms,
            fetch_max_wait_ms=int(fetch_max_wait_s * 1000),
        )
        self._known: set[str] = set()  # topics whose metadata the client has

    def assign(self, partitions: set[Partition]) -> None:
        """Read exactly these; a partition kept from the last assignment keeps its position."""
        self._consumer.assign([TopicPartition(t, p) for t, p in sorted(partitions)])

    def offset_at(self, partition: Partition, since_ms: int) -> int:
        """The first offset with a timestamp at or after `since_ms`, else the end of the partition."""
        tp = TopicPartition(*partition)
        found = self._consumer.offsets_for_times({tp: since_ms}, timeout_ms=self._timeout_ms).get(tp)
        return found.offset if found is not None else self.end_offset(partition)

    def end_offset(self, partition: Partition) -> int:
        tp = TopicPartition(*partition)
        return self._consumer.end_offsets([tp], timeout_ms=self._timeout_ms)[tp]

    def offsets_at(self, since: dict[Partition, int]) -> dict[Partition, int]:
        """`offset_at` of many partitions (each with its own time) in one request, and their ends in one
        more for those with nothing that late."""
        self._know_topics(since)
        tps = {TopicPartition(*p): ms for p, ms in since.items()}
        found = self._consumer.offsets_for_times(tps, timeout_ms=self._timeout_ms) if tps else {}
        offsets = {(tp.topic, tp.partition): f.offset for tp, f in found.items() if f is not None}
        missing = [p for p in since if p not in offsets]
        return offsets | self.end_offsets(missing)

    def end_offsets(self, partitions: list[Partition]) -> dict[Partition, int]:
        if not partitions:
            return {}
        self._know_topics(partitions)
        tps = [TopicPartition(*p) for p in partitions]
        try:
            ends = self._consumer.end_offsets(tps, timeout_ms=self._timeout_ms)
        except KeyError:
            # kafka-python leaves out (and then fails on) a partition whose leader it has not learnt yet,
            # as for a topic first read now: one at a time, each waiting for its metadata
            ends = {}
            for tp in tps:
                ends |= self._consumer.end_offsets([tp], timeout_ms=self._timeout_ms)
        return {(tp.topic, tp.partition): offset for tp, offset in ends.items()}

    def _know_topics(self, partitions: Iterable[Partition]) -> None:
        """The topics' metadata, asked for once (a look-up of a partition of an unknown topic fails)."""
        for topic in {t for t, _ in partitions} - self._known:
            if self._consumer.partitions_for_topic(topic):
                self._known.add(topic)

    def position(self, partition: Partition) -> int:
        return self._consumer.position(TopicPartition(*partition), timeout_ms=self._timeout_ms)

    def seek(self, partition: Partition, offset: int) -> None:
        self._consumer.seek(TopicPartition(*partition), offset)

    def poll(self, timeout_s: float) -> list[Record]:
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000))
        return [to_record(r) for records in batches.values() for r in records]

    def close(self) -> None:
        self._consumer.close(autocommit=False)
