"""Compressed batches on the real broker: the group consumer and the control reader read every codec other
clients write (gzip, snappy, lz4, zstd), and a batch they cannot decode comes up once, whole, as one
undecodable record, while what follows it is read at once."""

from __future__ import annotations

import time
import uuid

import kafka.codec
import kafka.record.default_records as default_records
import pytest
from kafka import KafkaProducer

from workers.kafka_io import BroadcastReader, GroupConsumer, Record
from workers.kafka_io.codec import install_bounds
from workers.services.kafka import ensure_topics

pytestmark = [pytest.mark.services, pytest.mark.timeout(180)]

CODECS = ("gzip", "snappy", "lz4", "zstd")


def _value(tag: str, i: int) -> bytes:
    return f'{{"job_id": "{tag}-{i}", "prompt": "{"compress me " * 40}"}}'.encode()


@pytest.fixture
def topic(settings) -> str:
    name = f"t{uuid.uuid4().hex[:10]}.codecs"
    ensure_topics(settings.kafka_connection, {name: 1})
    return name


def _produce(settings, topic: str, codec: str | None, values: list, partition: int | None = None, **options):
    """`values` (bytes, or (key, bytes)) in one batch: a long linger, then one flush; their offsets.
    With a codec, the batch is checked to have been compressed (kafka-python sends a batch that would not
    shrink as it is)."""
    producer = KafkaProducer(
        bootstrap_servers=settings.kafka, compression_type=codec, linger_ms=2000, **options
    )
    try:
        pairs = [v if isinstance(v, tuple) else (b"k", v) for v in values]
        futures = [producer.send(topic, key=k, value=v, partition=partition) for k, v in pairs]
        producer.flush(60)
        offsets = [f.get(60).offset for f in futures]
        rate = producer.metrics()["producer-metrics"]["compression-rate-avg"]
        assert rate < 1 if codec else rate == 1, (codec, rate)
        return offsets
    finally:
        producer.close()


def _readers(settings, topic: str, **options):
    """A group consumer and a control reader of `topic`, both waiting for what is written next."""
    group = GroupConsumer(settings.kafka_connection, f"{topic}-group", [topic], "inferq-test", **options)
    control = BroadcastReader(settings.kafka_connection, topic, "inferq-test-control", **options)
    _read(group, lambda rs: bool(group.assignment()), timeout_s=60)  # joined: reads from the start
    return group, control


def _read(reader, until, timeout_s: float = 60) -> list[Record]:
    records: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while not until(records) and time.monotonic() < deadline:
        records += reader.poll(0.5)
    return records


def test_the_group_consumer_and_the_control_reader_read_every_codec(settings, topic, monkeypatch):
    install_bounds()
    decoded = dict.fromkeys(CODECS, 0)
    for codec in CODECS:
        real = getattr(default_records, f"{codec}_decode")

        def spy(payload, codec=codec, real=real):
            decoded[codec] += 1
            return real(payload)

        monkeypatch.setattr(default_records, f"{codec}_decode", spy)
    group, control = _readers(settings, topic)
    try:
        expected = []
        for codec in CODECS:
            values = [_value(codec, i) for i in range(20)]
            _produce(settings, topic, codec, values)
            expected += values
        for reader in (group, control):
            records = _read(reader, lambda rs: len(rs) >= len(expected))
            assert [r.value for r in records] == expected
            assert [r.offset for r in records] == list(range(len(expected)))
            assert not any(r.undecodable for r in records)
        assert all(n >= 2 for n in decoded.values()), decoded  # each codec's batch, by each reader
    finally:
        group.close()
        control.close()


def _count_decodes(monkeypatch, codec: str) -> list[int]:
    """How often kafka-python decompresses a `codec` batch from now on (through the bound), in [0]."""
    install_bounds()
    calls = [0]
    real = getattr(default_records, f"{codec}_decode")

    def spy(payload):
        calls[0] += 1
        return real(payload)

    monkeypatch.setattr(default_records, f"{codec}_decode", spy)
    return calls


# cause -> the codec of the bad batch
CAUSES = {"codec-missing": "snappy", "zstd-bomb": "zstd", "gzip-bomb": "gzip"}


@pytest.mark.parametrize("cause", sorted(CAUSES))
@pytest.mark.parametrize("which", ["group", "control"])
def test_an_undecodable_batch_comes_up_once_whole_and_what_follows_is_read_at_once(
    settings, topic, monkeypatch, which, cause
):
    bad_codec = CAUSES[cause]
    before_codec, after_codec = [c for c in CODECS if c != bad_codec][:2]
    group, control = _readers(settings, topic, max_decompressed_bytes=2**20)
    reader, other = (group, control) if which == "group" else (control, group)
    other.close()
    try:
        before = [_value(before_codec, i) for i in range(3)]
        _produce(settings, topic, before_codec, before)
        if cause == "codec-missing":  # snappy (franz-go's default) read where its codec is missing
            bad = _produce(settings, topic, bad_codec, [_value(bad_codec, i) for i in range(5)])
        else:  # five records of 400 kB of zeros: 2 MB inflated, past the 1 MiB bound; a few kB compressed
            zeros = [bytes(400_000) for _ in range(5)]
            bad = _produce(
                settings, topic, bad_codec, zeros, batch_size=4 * 2**20, max_request_size=4 * 2**20
            )
        assert bad == list(range(bad[0], bad[0] + 5))
        after = [_value(after_codec, i) for i in range(3)]
        _produce(settings, topic, after_codec, after)
        if cause == "codec-missing":
            monkeypatch.setattr(kafka.codec, "has_snappy", lambda: False)
        decodes = _count_decodes(monkeypatch, bad_codec)

        records = _read(reader, lambda rs: len(rs) >= 7)
        assert [r.value for r in records[:3]] == before
        [stand_in] = [r for r in records if r.undecodable]
        assert (stand_in.offset, stand_in.last_offset) == (bad[0], bad[-1])
        assert f"offsets {bad[0]}..{bad[-1]}" in stand_in.undecodable
        assert ("snappy" if cause == "codec-missing" else "inflates past") in stand_in.undecodable
        assert stand_in.value is None and stand_in.source == (topic, 0)
        assert [r.value for r in records[4:]] == after  # the same fetch goes on after the bad batch

        started = time.monotonic()
        later = [_value("plain", i) for i in range(3)]
        _produce(settings, topic, None, later)
        more = _read(reader, lambda rs: len(rs) >= 3, timeout_s=30)
        assert [r.value for r in more] == later
        assert time.monotonic() - started < 15
        assert _read(reader, lambda rs: False, timeout_s=2) == []  # the bad batch never comes again
        assert decodes[0] == (0 if cause == "codec-missing" else 1)  # a bomb is inflated once, not per record
    finally:
        reader.close()
