"""The pure parts of reading compressed batches: every codec's decompression bound, the record that stands
for an undecodable batch (on batches kafka-python builds and parses), the offsets it finishes, and the
producers' compression setting."""

from __future__ import annotations

import struct
import time
from types import SimpleNamespace

import kafka.codec
import kafka.record.default_records as default_records
import pytest
from kafka import TopicPartition
from kafka.consumer.fetcher import Fetcher
from kafka.record.memory_records import MemoryRecords, MemoryRecordsBuilder

from workers.kafka_io import Record
from workers.kafka_io.batches import _guarded, recover
from workers.kafka_io.codec import (
    DecompressedTooLarge,
    bounded_decoder,
    decompression_bound,
    install_bounds,
)
from workers.kafka_io.records import UndecodableBatch, to_record
from workers.serving.offsets import OffsetTracker
from workers.settings import KafkaConnection, Settings

TEXT = b"the same words again and again " * 100_000  # 3.1 MB that compresses well under every codec

ENCODERS = {
    "gzip": kafka.codec.gzip_encode,
    "snappy": kafka.codec.snappy_encode,  # the xerial framing, as the Java client writes it
    "snappy-raw": lambda data: kafka.codec.snappy_encode(data, xerial_compatible=False),  # as franz-go
    "lz4": kafka.codec.lz4_encode,
    "zstd": kafka.codec.zstd_encode,
}


@pytest.mark.parametrize("codec", sorted(ENCODERS))
def test_every_codec_is_inflated_only_up_to_the_bound(codec):
    payload = ENCODERS[codec](TEXT)
    assert len(payload) < len(TEXT) // 10
    decode = bounded_decoder(codec.removesuffix("-raw"), 4 * 2**20)
    assert decode(payload) == TEXT
    with pytest.raises(DecompressedTooLarge):
        bounded_decoder(codec.removesuffix("-raw"), 2**20)(payload)


def test_a_snappy_block_that_claims_gigabytes_is_refused_before_it_is_inflated():
    # a raw snappy block states its length first (varint): here 4 GiB - 1, which a decoder would allocate
    bomb = b"\xff\xff\xff\xff\x0f" + kafka.codec.snappy_encode(b"x", xerial_compatible=False)[1:]
    started = time.monotonic()
    with pytest.raises(DecompressedTooLarge):
        bounded_decoder("snappy", 64 * 2**20)(bomb)
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_kafka_python_decodes_every_codec_through_the_bound_in_force(codec):
    install_bounds()
    payload = ENCODERS[codec](TEXT)
    decode = getattr(default_records, f"{codec}_decode")
    assert decode(payload) == TEXT  # the default bound (64 MiB)
    with decompression_bound(2**20), pytest.raises(DecompressedTooLarge):
        decode(payload)
    assert decode(payload) == TEXT  # the block's bound ends with it


class _ConsumerRecord:
    def __init__(self, offset, value):
        self.topic, self.partition, self.offset, self.key, self.value = "jobs", 3, offset, None, value
        self.timestamp, self.headers = 1_700_000_000_000, ()


def test_an_undecodable_batch_becomes_one_record_spanning_it():
    record = to_record(_ConsumerRecord(14, UndecodableBatch(10, 14, "record batch (offsets 10..14) ...")))
    assert (record.offset, record.last_offset, record.next_offset) == (10, 14, 15)
    assert record.undecodable.startswith("record batch") and record.value is None
    plain = Record("jobs", 3, 7, b"k", b"v", 0)
    assert (plain.last_offset, plain.next_offset) == (7, 8)
    assert to_record(_ConsumerRecord(8, b"v")).last_offset == 8


def test_acking_the_record_of_an_undecodable_batch_finishes_its_every_offset():
    offsets = OffsetTracker()
    p = ("jobs", 0)
    offsets.track(p, 9)
    offsets.track(p, 10, 14)  # one record for the batch 10..14
    offsets.ack(p, 9)
    assert offsets.committable() == {p: 10}
    offsets.ack(p, 10)
    assert offsets.committable() == {p: 15}  # not 11: reading on from 11 would meet the same batch again
    offsets.track(p, 15)
    assert offsets.committable() == {p: 15}


def test_producers_compress_as_configured_and_a_wrong_value_is_refused():
    assert Settings.from_env({}).kafka_connection.producer_options()["compression_type"] is None
    for value, expected in (("zstd", "zstd"), ("LZ4", "lz4"), (" snappy ", "snappy"), ("none", None)):
        conn = Settings.from_env({"INFERQ_KAFKA_COMPRESSION": value}).kafka_connection
        assert conn.producer_options()["compression_type"] == expected
        assert "compression_type" not in conn.client_options()  # consumers and admins take no such option
    with pytest.raises(ValueError, match="INFERQ_KAFKA_COMPRESSION='brotli'; use one of"):
        Settings.from_env({"INFERQ_KAFKA_COMPRESSION": "brotli"})
    with pytest.raises(ValueError, match="INFERQ_KAFKA_COMPRESSION"):
        KafkaConnection("127.0.0.1:9092", compression="snapy")


# ---- the batch guard, on batches built and parsed by kafka-python itself (no broker needed) ----------


def _batch(offset: int, values: list[bytes], compression: int = 0) -> bytearray:
    """A v2 batch as the broker stores it: the producer's, with the base offset the broker gave it."""
    builder = MemoryRecordsBuilder(magic=2, compression_type=compression, batch_size=64 << 20)
    for v in values:
        assert builder.append(timestamp=1_700_000_000_000, key=None, value=v) is not None
    builder.close()
    batch = bytearray(builder.buffer())
    struct.pack_into(">q", batch, 0, offset)  # BaseOffset (outside the CRC)
    return batch


def _read_fetch(data: bytes, fetch_offset: int = 0, highwater: int | None = None) -> list[Record]:
    """The records a guarded consumer hands out of one fetch response holding `data`."""
    install_bounds()
    tp = TopicPartition("jobs", 0)
    state = SimpleNamespace(highwater=highwater)
    fetcher = SimpleNamespace(_subscriptions=SimpleNamespace(assignment={tp: state}))
    part = _guarded(Fetcher.PartitionRecords, 2**20, fetcher)(fetch_offset, tp, MemoryRecords(bytes(data)))
    return [to_record(r) for r in part.take()]


def _summary(records: list[Record]) -> list:
    return [(r.offset, r.last_offset) if r.undecodable else r.value for r in records]


def test_a_batch_that_fails_its_crc_is_one_stand_in_and_the_fetch_goes_on():
    bad = _batch(3, [b"d", b"e"])
    bad[-1] ^= 0xFF  # a flipped bit in its last record: the batch CRC no longer matches
    data = _batch(0, [b"a", b"b", b"c"]) + bad + _batch(5, [b"f"])
    records = _read_fetch(data)
    assert _summary(records) == [b"a", b"b", b"c", (3, 4), b"f"]
    assert "CRC" in records[3].undecodable


def test_a_corrupt_header_never_skips_past_the_next_batch_or_the_partition_end():
    bad = _batch(3, [b"d", b"e"])
    struct.pack_into(">i", bad, 23, 1_000_000)  # LastOffsetDelta (under the CRC): a million records
    assert _summary(_read_fetch(_batch(0, [b"a"] * 3) + bad + _batch(5, [b"f"]))) == [
        *[b"a"] * 3, (3, 4), b"f",
    ]  # fmt: skip
    assert _summary(_read_fetch(_batch(0, [b"a"] * 3) + bad, highwater=5)) == [*[b"a"] * 3, (3, 4)]


def test_a_batch_the_bound_refuses_is_inflated_once_and_stood_in_for_whole():
    gzip = 1  # the codec number in a batch's attributes
    data = _batch(0, [b"a"]) + _batch(1, [bytes(600_000)] * 4, gzip) + _batch(5, [b"f"], gzip)
    records = _read_fetch(data)
    assert _summary(records) == [b"a", (1, 4), b"f"]
    assert "inflates past 1048576 bytes" in records[1].undecodable


def test_a_fetch_that_starts_inside_a_bad_batch_stands_in_for_the_rest_of_it():
    data = _batch(0, [bytes(600_000)] * 4, 1) + _batch(4, [b"e"])
    assert _summary(_read_fetch(data, fetch_offset=2)) == [(2, 3), b"e"]


def test_a_slice_too_short_to_be_a_batch_is_stepped_over_by_one_offset():
    runt = struct.pack(">qi", 3, 4) + b"\x00" * 4  # base offset 3, a length no batch header fits in
    assert _summary(_read_fetch(_batch(0, [b"a", b"b", b"c"]) + runt)) == [b"a", b"b", b"c", (3, 3)]


def test_after_records_raise_the_fetch_slot_is_emptied_and_their_offset_stepped_over():
    class Deserializer:  # anything the guard does not foresee, raised from the client's records
        def deserialize(self, topic, headers, data):
            if data == b"boom":
                raise RuntimeError("not foreseen")
            return data

    tp = TopicPartition("jobs", 0)
    fetcher = SimpleNamespace(_subscriptions=SimpleNamespace(assignment={}))
    guarded = _guarded(Fetcher.PartitionRecords, 2**20, fetcher)
    part = guarded(
        7, tp, MemoryRecords(bytes(_batch(7, [b"a", b"boom", b"c"]))), value_deserializer=Deserializer()
    )
    assert [r.value for r in part.take()] == [b"a"]  # the error waits for the next take
    with pytest.raises(RuntimeError):
        part.take()
    assert not part  # drained: the fetcher takes the next fetch instead of spinning on this one
    seeks = []
    consumer = SimpleNamespace(
        _fetcher=SimpleNamespace(_next_partition_records=part), seek=lambda *a: seeks.append(a)
    )
    [record] = recover(consumer, RuntimeError("not foreseen"), "test")
    assert (record.offset, record.last_offset, seeks) == (8, 8, [(tp, 9)])
    assert "cannot be decoded" in record.undecodable and consumer._fetcher._next_partition_records is None

    healthy = guarded(7, tp, MemoryRecords(bytes(_batch(7, [b"a"]))))
    consumer._fetcher._next_partition_records = healthy
    assert recover(consumer, OSError("a broker error"), "test") == []  # not the records' fault: no skip
    assert seeks == [(tp, 9)] and consumer._fetcher._next_partition_records is None
