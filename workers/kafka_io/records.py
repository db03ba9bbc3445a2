"""Plain records and partitions, as the rest of the worker sees them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from kafka.partitioner.default import murmur2

from schemas.topics import Coordinates, Partition

MAX_CLOCK_SKEW_S = 3600.0  # how far ahead of ours a producer's clock may be


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    headers: tuple[tuple[str, bytes], ...] = ()
    undecodable: str = ""  # set when the client could not decode the record (its value is then None)

    @property
    def source(self) -> Partition:
        return (self.topic, self.partition)

    @property
    def coordinates(self) -> Coordinates:
        return (self.topic, self.partition, self.offset)

    def posted_at(self, now: datetime) -> datetime:
        """When the producer posted it (the Kafka timestamp), or `now` for a record without a believable one.

        A timestamp is the producer's claim: one further ahead than any clock skew (up to year 9999 and
        past it) is not believed, so job timings and deadlines stay computable."""
        if self.timestamp_ms <= 0 or self.timestamp_ms / 1000 > now.timestamp() + MAX_CLOCK_SKEW_S:
            return now
        return datetime.fromtimestamp(self.timestamp_ms / 1000, UTC)


def to_record(r) -> Record:
    return Record(r.topic, r.partition, r.offset, r.key, r.value, r.timestamp, tuple(r.headers or ()))


def partition_for_key(key: str, num_partitions: int) -> int:
    """The partition Kafka's default partitioner picks for a key (murmur2, as the Java client)."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % num_partitions
