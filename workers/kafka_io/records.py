"""Plain records and partitions, as the rest of the worker sees them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from kafka.partitioner.default import murmur2

from schemas.topics import Coordinates, Partition

MAX_CLOCK_SKEW_S = 3600.0  # how far ahead of ours a producer's clock may be


@dataclass(frozen=True)
class UndecodableBatch:
    """The value kafka_io gives the one record standing in for a batch it could not decode (never bytes, so
    no producer can forge one); `to_record` turns it into an undecodable `Record`."""

    first_offset: int
    last_offset: int
    reason: str

    def __len__(self) -> int:  # kafka-python measures every value it hands out
        return 0


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
    # The last offset this record stands for: its own offset, except for an undecodable record, which
    # stands for its whole batch (offset .. last_offset, every one of them done once it is dead-lettered).
    last_offset: int = -1
    generation: int = 0  # the consumer-group generation it was fetched in (0: read outside a group)

    def __post_init__(self) -> None:
        if self.last_offset < self.offset:
            object.__setattr__(self, "last_offset", self.offset)

    @property
    def source(self) -> Partition:
        return (self.topic, self.partition)

    @property
    def coordinates(self) -> Coordinates:
        return (self.topic, self.partition, self.offset)

    @property
    def next_offset(self) -> int:
        """Where reading goes on after this record (past its whole batch for an undecodable one)."""
        return self.last_offset + 1

    def posted_at(self, now: datetime) -> datetime:
        """When the producer posted it (the Kafka timestamp), or `now` for a record without a believable one.

        A timestamp is the producer's claim: one further ahead than any clock skew (up to year 9999 and
        past it) is not believed, so job timings and deadlines stay computable."""
        if self.timestamp_ms <= 0 or self.timestamp_ms / 1000 > now.timestamp() + MAX_CLOCK_SKEW_S:
            return now
        return datetime.fromtimestamp(self.timestamp_ms / 1000, UTC)


def to_record(r, generation: int = 0) -> Record:
    if type(r.value) is UndecodableBatch:  # the stand-in of a batch kafka_io could not decode
        first, last, reason = r.value.first_offset, r.value.last_offset, r.value.reason
        return Record(r.topic, r.partition, first, None, None, r.timestamp, (), reason, last, generation)
    headers = tuple(r.headers or ())
    return Record(r.topic, r.partition, r.offset, r.key, r.value, r.timestamp, headers, "", -1, generation)


def partition_for_key(key: str, num_partitions: int) -> int:
    """The partition Kafka's default partitioner picks for a key (murmur2, as the Java client)."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % num_partitions
