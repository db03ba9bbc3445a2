"""The one module that imports kafka-python: a group consumer, a broadcast reader and a producer.

Everything above this works with the plain `Record` dataclass and (topic, partition) tuples, so the
bookkeeping (offsets, intake, loop) stays testable and independent of the client library.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import CommitFailedError, KafkaError
from kafka.partitioner.default import murmur2
from kafka.structs import OffsetAndMetadata

log = logging.getLogger(__name__)

Partition = tuple[str, int]


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    headers: tuple[tuple[str, bytes], ...] = ()

    @property
    def source(self) -> Partition:
        return (self.topic, self.partition)


def _to_record(r) -> Record:
    return Record(r.topic, r.partition, r.offset, r.key, r.value, r.timestamp, tuple(r.headers or ()))


def partition_for_key(key: str, num_partitions: int) -> int:
    """The partition Kafka's default partitioner picks for a key (murmur2, as the Java client)."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % num_partitions


@dataclass
class RebalanceEvents:
    """Revocations and assignments, recorded on the client's I/O thread and drained by the engine loop."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _events: collections.deque = field(default_factory=collections.deque)

    def push(self, kind: str, partitions: Iterable[TopicPartition]) -> None:
        with self._lock:
            self._events.append((kind, [(tp.topic, tp.partition) for tp in partitions]))

    def drain(self) -> list[tuple[str, list[Partition]]]:
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events


class _Listener(ConsumerRebalanceListener):
    def __init__(self, events: RebalanceEvents) -> None:
        self.events = events

    def on_partitions_revoked(self, revoked) -> None:
        self.events.push("revoked", revoked)

    def on_partitions_assigned(self, assigned) -> None:
        self.events.push("assigned", assigned)

    def on_partitions_lost(self, lost) -> None:
        self.events.push("revoked", lost)


class GroupConsumer:
    """A consumer-group member over the jobs topics; offsets are committed only by `commit`."""

    def __init__(self, bootstrap: str, group_id: str, topics: Sequence[str], client_id: str) -> None:
        self.rebalances = RebalanceEvents()
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=group_id,
            client_id=client_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=256,
            # a generation step is short, but a slow first model load must not cost the membership
            max_poll_interval_ms=300_000,
            session_timeout_ms=10_000,
            heartbeat_interval_ms=2_000,
        )
        self._consumer.subscribe(list(topics), listener=_Listener(self.rebalances))

    def poll(self, timeout_s: float, max_records: int | None = None) -> list[Record]:
        self._unpark_resumed()
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        return [_to_record(r) for records in batches.values() for r in records]

    def _unpark_resumed(self) -> None:
        """Work around kafka-python 3.0 losing resumed partitions for good.

        Records fetched for a partition while it was paused are parked, and the partition is not fetched
        again until they are handed back. The fetcher hands them back only when its in-line slot is None,
        but a drained slot stays a (falsy) records object, so after pause → resume the partition is never
        read again: the worker stalls on a backlog. A drained slot and None mean the same to the fetcher.
        """
        fetcher = getattr(self._consumer, "_fetcher", None)
        parked = fetcher is not None and getattr(fetcher, "_paused_partition_records", None)
        if parked and not fetcher._next_partition_records:
            fetcher._next_partition_records = None

    def assignment(self) -> set[Partition]:
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def pause(self, topics: Iterable[str]) -> None:
        wanted = set(topics)
        parts = [tp for tp in self._consumer.assignment() if tp.topic in wanted]
        if parts:
            self._consumer.pause(*parts)

    def resume(self, topics: Iterable[str]) -> None:
        wanted = set(topics)
        parts = [tp for tp in self._consumer.paused() if tp.topic in wanted]
        if parts:
            self._consumer.resume(*parts)

    def commit(self, offsets: dict[Partition, int]) -> bool:
        """Commit next-offsets to read; False when the group moved on (the new owner redoes the rest)."""
        if not offsets:
            return True
        payload = {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()}
        try:
            self._consumer.commit(payload)
            return True
        except (CommitFailedError, KafkaError) as exc:
            log.warning("offset commit failed (%s); uncommitted jobs will be redelivered", exc)
            return False

    def close(self) -> None:
        self._consumer.close(autocommit=False)


class BroadcastReader:
    """Reads every partition of a topic from its end, outside any group: every worker sees every message."""

    def __init__(self, bootstrap: str, topic: str, client_id: str) -> None:
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap, client_id=client_id, enable_auto_commit=False
        )
        parts = self._consumer.partitions_for_topic(topic) or {0}
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        self._consumer.assign(tps)
        self._consumer.seek_to_end(*tps)

    def poll(self, timeout_s: float = 0.0) -> list[Record]:
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000))
        return [_to_record(r) for records in batches.values() for r in records]

    def close(self) -> None:
        self._consumer.close(autocommit=False)


class TopicReader:
    """Reads a topic from a point in time, outside any group; with `key`, only that key's records.

    Used by `tail`, `submit --stream/--wait` and the demo. `since_ms=None` starts at the end.
    """

    def __init__(
        self, bootstrap: str, topic: str, since_ms: int | None, client_id: str, key: str | None = None
    ) -> None:
        self.key = key.encode() if key is not None else None
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap, client_id=client_id, enable_auto_commit=False
        )
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
        return [_to_record(r) for r in records if self.key is None or r.key == self.key]

    def close(self) -> None:
        self._consumer.close(autocommit=False)


@dataclass(frozen=True)
class Delivery:
    """A sent message; `wait` blocks until the broker has it (without forcing out everything else)."""

    _future: Any

    def wait(self, timeout_s: float = 30.0) -> None:
        self._future.get(timeout=timeout_s)


class Producer:
    def __init__(self, bootstrap: str, client_id: str, linger_ms: int = 5) -> None:
        self._producer = KafkaProducer(
            bootstrap_servers=bootstrap,
            client_id=client_id,
            acks="all",
            linger_ms=linger_ms,
            compression_type=None,
        )

    def send(
        self, topic: str, key: str | bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]] = ()
    ) -> Delivery:
        raw_key = key.encode() if isinstance(key, str) else key
        return Delivery(self._producer.send(topic, value=value, key=raw_key, headers=list(headers) or None))

    def flush(self, timeout_s: float | None = None) -> None:
        self._producer.flush(timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self._producer.close(timeout=timeout_s)


def group_client_ids(bootstrap: str, group_id: str) -> set[str]:
    """client_ids of a consumer group's live members (bulk maintenance uses it to find dead workers)."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="inferq-admin")
    try:
        group = admin.describe_groups([group_id])[group_id]
    finally:
        admin.close()
    if group.get("error"):
        raise KafkaError(group["error"])
    return {member["client_id"] for member in group.get("members", [])}


def group_members(bootstrap: str, group: str) -> int:
    """Members of a consumer group once it is stable (0 while it rebalances or does not exist)."""
    from kafka.admin import KafkaAdminClient

    with KafkaAdminClient(bootstrap_servers=bootstrap, client_id="inferq-admin") as admin:
        try:
            info = admin.describe_groups([group]).get(group, {})
        except KafkaError:  # e.g. a new broker whose group coordinator is not up yet
            return 0
    state = info.get("group_state") or info.get("state")
    return len(info.get("members", [])) if state == "Stable" else 0
