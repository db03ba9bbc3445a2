"""A record batch that cannot be decoded comes up once, whole, as one record; nothing wedges the fetcher.

kafka-python turns a fetched partition into records lazily, in one generator per fetch response. When a
batch fails (its CRC, a codec the process lacks, a corrupt record, the decompression bound), the error is
raised out of `poll` and the generator is finished for good, but it still holds the fetcher's in-line
slot: every later `poll` spins on it, and the consumer never reads that partition again.

So each batch is checked as a whole before the generator sees it: the CRC is validated, the batch is
decompressed (within the bound) and every record parsed. A batch that passes is handed on already decoded;
one that fails is replaced by a stand-in batch of one record whose value is an `UndecodableBatch` (no
bytes a producer could forge): the client returns it like any record and its position moves past the
whole batch. `to_record` turns it into one `Record` with `undecodable` set, spanning `offset` ..
`last_offset`. Nothing is raised, so the generator goes on with the next batch of the same fetch.

Whatever still raises out of `poll` (a broker error, a batch too short to have a header, a client bug) is
handled by `recover`: the fetcher's slot is emptied (records not handed out yet are fetched again from the
position) and, for a decoding error, the offset the client was stuck at is handed up and stepped over.
"""

from __future__ import annotations

import logging
import struct
import zlib
from typing import Any

from kafka import KafkaConsumer
from kafka.errors import CorruptRecordError, UnsupportedCodecError

from workers.kafka_io.codec import DecompressedTooLarge, decompression_bound, install_bounds
from workers.kafka_io.records import Record, UndecodableBatch

log = logging.getLogger(__name__)

# What the client raises when a fetched batch cannot be turned into records (also with the guard missing).
UNDECODABLE = (
    CorruptRecordError,
    UnsupportedCodecError,
    DecompressedTooLarge,
    zlib.error,
    EOFError,
    OSError,
    ValueError,
)
_REASON_CHARS = 500


def describe(exc: BaseException) -> str:
    """`Type: message`, without the type twice (kafka-python's errors name themselves)."""
    text, name = str(exc), type(exc).__name__
    return text if text.startswith(name) else f"{name}: {text}"


class _StandInRecord:
    """The one record of a stand-in batch, shaped as the client reads records."""

    __slots__ = ("offset", "timestamp", "timestamp_type", "value", "size_in_bytes")

    key = None
    headers = ()
    checksum = None

    def __init__(self, offset: int, timestamp: int, value: Any, size: int) -> None:
        self.offset = offset
        self.timestamp = timestamp
        self.timestamp_type = 0
        self.value = value
        self.size_in_bytes = size

    def validate_crc(self) -> bool:
        return True


class _StandInBatch:
    """Replaces a batch that failed: one record at its last offset, so the position moves past it all.

    It claims the v2 format (whatever the real one), which is all the client's generator needs to take
    `next_offset` from it; a control batch (transaction markers, never data) is skipped by the client.
    """

    magic = 2
    producer_id = -1
    is_transactional = False

    def __init__(self, last_offset: int, leader_epoch: int, control: bool, record: _StandInRecord | None):
        self.last_offset = last_offset
        self.next_offset = last_offset + 1
        self.leader_epoch = leader_epoch
        self.is_control_batch = control
        self._records = [record] if record is not None else []

    def has_producer_id(self) -> bool:
        return False

    def validate_crc(self) -> bool:
        return True

    def __iter__(self):
        return iter(self._records)


class _DecodedBatch:
    """A batch already checked and decoded: the client's generator reads its records from memory."""

    def __init__(self, batch, records: list) -> None:
        self._batch = batch
        self._records = records

    def __getattr__(self, name: str):
        return getattr(self._batch, name)

    def validate_crc(self) -> bool:
        return True  # checked before the records were read (the client may not ask after decompression)

    def __iter__(self):
        return iter(self._records)


def _next_base_offset(records) -> int | None:
    """The base offset of the batch after the one just taken from `records` (a MemoryRecords), if any."""
    nxt = getattr(records, "_next_slice", None)
    if nxt is None or len(nxt) < 8:
        return None
    return struct.unpack_from(">q", nxt, 0)[0]


class _CheckedBatches:
    """Stands between a fetch's MemoryRecords and the client's generator: batch by batch, as it reads."""

    def __init__(self, records, part, limit: int, highwater) -> None:
        self._records = records
        self._part = part
        self._limit = limit
        self._highwater = highwater  # () -> the partition's high watermark from this fetch, or None
        self._broken = False

    def next_batch(self):
        if self._broken:
            return None
        part = self._part
        try:
            batch = self._records.next_batch()
        except Exception as exc:  # noqa: BLE001 - a slice too short to be a batch: its extent is unknown
            self._broken = True  # the rest of this fetch cannot be framed; the next fetch starts after it
            first = part.next_fetch_offset
            return self._stand_in(first, first, part.leader_epoch, False, exc)
        if batch is None:
            return None
        v2 = batch.magic >= 2
        check_crcs = part.check_crcs
        if v2 and batch.is_control_batch:
            if not check_crcs or batch.validate_crc():
                return batch
            return self._failed(batch, CorruptRecordError("control batch fails its CRC check"), trusted=False)
        if check_crcs and not batch.validate_crc():
            return self._failed(batch, CorruptRecordError("record batch fails its CRC check"), trusted=False)
        try:
            if batch.compression_type:
                with decompression_bound(self._limit):
                    records = list(batch)
            else:
                records = list(batch)
            if check_crcs and not v2:  # a v2 record has no CRC of its own (the batch's covers it)
                for r in records:
                    if not r.validate_crc():
                        raise CorruptRecordError(f"record at offset {r.offset} fails its CRC check")
        except Exception as exc:  # noqa: BLE001 - whatever breaks decoding a batch belongs to that batch
            return self._failed(batch, exc, trusted=True)
        return _DecodedBatch(batch, records)

    def _failed(self, batch, exc: Exception, trusted: bool):
        """The stand-in of `batch`. `trusted`: its header passed the CRC (its last offset is sound)."""
        part = self._part
        first = part.next_fetch_offset  # records before it were handed out already (or skipped)
        if batch.magic >= 2:
            first = max(first, batch.base_offset)
            last, epoch = batch.last_offset, batch.leader_epoch
            ts = batch.max_timestamp if batch.timestamp_type == 1 else batch.first_timestamp
        else:  # a legacy wrapper message carries the offset of its last inner record
            last, epoch, ts = batch.base_offset, part.leader_epoch, -1
        if not trusted:
            # A header that failed its CRC may state any last offset: never skip past the next batch of
            # this fetch, nor past the partition's end (a seek there would reset the position to the start).
            for bound in (_next_base_offset(self._records), self._highwater()):
                if bound is not None and bound > first:
                    last = min(last, bound - 1)
        last = max(last, first)
        control = batch.magic >= 2 and batch.is_control_batch
        return self._stand_in(first, last, epoch, control, exc, ts, batch.size_in_bytes)

    def _stand_in(
        self, first: int, last: int, epoch: int, control: bool, exc: Exception, ts: int = -1, size: int = 0
    ):
        tp = self._part.topic_partition
        what = "control batch" if control else "record batch"
        where = f"{tp.topic}:{tp.partition}@{first}..{last}"
        log.error("%s %s cannot be decoded (%s); skipped", what, where, describe(exc))
        if control:
            return _StandInBatch(last, epoch, True, None)
        span = f"offset {first}" if first == last else f"offsets {first}..{last}"
        reason = f"record batch ({span}) cannot be decoded: {describe(exc)}"[:_REASON_CHARS]
        value = UndecodableBatch(first, last, reason)
        return _StandInBatch(last, epoch, False, _StandInRecord(last, ts, value, size))


def _guarded(base: type, limit: int, fetcher) -> type:
    """A subclass of the client's PartitionRecords that reads through `_CheckedBatches`."""

    def highwater_of(tp):
        def highwater():
            try:
                return fetcher._subscriptions.assignment[tp].highwater
            except Exception:  # noqa: BLE001 - unassigned meanwhile, or another client version
                return None

        return highwater

    class GuardedPartitionRecords(base):
        failed_at: int | None = None  # where its records raised, if they did

        def _unpack_records(self, tp, records, *args, **kwargs):
            checked = _CheckedBatches(records, self, limit, highwater_of(tp))
            return super()._unpack_records(tp, checked, *args, **kwargs)

        def take(self, *args, **kwargs):
            try:
                return super().take(*args, **kwargs)
            except Exception:
                # the generator that raised is finished: where it stopped, and an empty slot, not a spin
                self.failed_at = self.next_fetch_offset
                self.drain()
                raise

    return GuardedPartitionRecords


def guard(consumer: KafkaConsumer, max_decompressed_bytes: int) -> bool:
    """Make `consumer` hand up undecodable batches as stand-in records; False if this client version has
    no place for it (then `recover` steps over such batches an offset at a time)."""
    install_bounds()
    fetcher = getattr(consumer, "_fetcher", None)
    base = getattr(fetcher, "PartitionRecords", None)
    if base is None or not hasattr(base, "_unpack_records") or not hasattr(base, "take"):
        log.warning("kafka-python has no PartitionRecords to guard: undecodable batches are stepped over")
        return False
    fetcher.PartitionRecords = _guarded(base, max_decompressed_bytes, fetcher)
    return True


def recover(consumer: KafkaConsumer, exc: Exception, what: str) -> list[Record]:
    """After `poll` raised: empty the fetcher's in-line slot so the next poll makes progress.

    When the records of a partition raised (the guard saw its generator fail; without the guard, a decoding
    error), the offset they stopped at is handed up as undecodable and stepped over: fetched again, it
    would only fail again. Any other error (the broker, the group) leaves the position as it is.
    """
    fetcher = getattr(consumer, "_fetcher", None)
    part = getattr(fetcher, "_next_partition_records", None)
    if part is None:
        log.warning("%s: poll failed (%s); trying again", what, describe(exc))
        return []
    tp = part.topic_partition
    offset = getattr(part, "failed_at", None)
    guarded = hasattr(type(part), "failed_at")
    part.drain()
    fetcher._next_partition_records = None
    if offset is None and not guarded and isinstance(exc, UNDECODABLE):
        offset = part.next_fetch_offset
    if offset is None:
        log.warning("%s: poll failed (%s); fetching %s:%d again", what, describe(exc), tp.topic, tp.partition)
        return []
    try:
        consumer.seek(tp, offset + 1)
    except Exception as seek_exc:  # noqa: BLE001 - no longer assigned: its next owner meets the record
        log.warning("%s: cannot step over %s:%d@%d (%s)", what, tp.topic, tp.partition, offset, seek_exc)
        return []
    where = f"{tp.topic}:{tp.partition}@{offset}"
    log.error("%s: record %s cannot be decoded (%s); skipped", what, where, describe(exc))
    reason = f"record cannot be decoded: {describe(exc)}"[:_REASON_CHARS]
    return [Record(tp.topic, tp.partition, offset, None, None, -1, (), undecodable=reason)]
