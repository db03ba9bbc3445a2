"""Compressed batches on the real broker: the group consumer and the control reader read every codec other
clients write (gzip, snappy, lz4, zstd), and a batch they cannot decode comes up once, whole, as one
undecodable record, while what follows it is read at once; a worker runs compressed jobs and cancels and
dead-letters a bomb batch once."""

from __future__ import annotations

import json
import time
import uuid

import kafka.codec
import kafka.record.default_records as default_records
import pytest
from kafka import KafkaProducer

from tests.workers.worker_factories import (
    job_rows,
    now_ms,
    read_topic,
    results_by_job,
    serving_worker,
    wait_status,
    wait_terminal,
)
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_serves_compressed_jobs_and_cancels_and_dead_letters_a_bomb_batch_once(settings, tmp_path):
    env = {"INFERQ_KAFKA_COMPRESSION": "zstd"}  # the worker's own producers compress (results, dead letters)
    with serving_worker(settings, tmp_path, "w-codecs", env=env) as (dep, client, db, worker):
        p, since, low = dep.topic_prefix, now_ms(), dep.topics.jobs("low")
        posted = []
        for n, codec in enumerate(CODECS):  # each codec's batch in one partition of a jobs topic
            jobs = [f"{codec}-{i}-{p}" for i in range(3)]
            values = [
                (
                    j.encode(),
                    json.dumps({"job_id": j, "prompt": "compress me " * 30, "max_tokens": 3}).encode(),
                )
                for j in jobs
            ]
            topic = dep.topics.jobs(("high", "normal", "low", "normal")[n])
            _produce(dep, topic, codec, values, partition=n % 4)
            posted += jobs
        long_job = client.submit({"job_id": f"long-{p}", "prompt": "go on", "max_tokens": 2000}).job_id
        client.flush()
        wait_status(db, long_job, "running")
        # its cancel in an lz4 batch, among cancels of jobs nobody posted
        ghosts = [f"ghost-{i}-{p}" for i in range(10)]
        cancels = [
            (j.encode(), json.dumps({"type": "cancel", "job_id": j, "tenant": "default"}).encode())
            for j in [*ghosts, long_job]
        ]
        _produce(dep, dep.topics.control, "lz4", cancels)
        # bombs past the worker's 64 MiB bound: one zstd record on control, a batch of five lz4 on jobs.low
        big = {"max_request_size": 200 * 2**20, "batch_size": 200 * 2**20}
        [control_bomb] = _produce(dep, dep.topics.control, "zstd", [(b"bomb", bytes(80 * 2**20))], **big)
        bomb = _produce(dep, low, "lz4", [(b"bomb", bytes(16 * 2**20))] * 5, partition=0, **big)
        after = client.submit({"job_id": f"after-{p}", "prompt": "still here", "max_tokens": 3}, "low").job_id
        client.flush()

        bomb_id = f"{low}:0:{bomb[0]}"  # the id of a job without one: topic:partition:offset
        rows = wait_terminal(db, [*posted, long_job, after, bomb_id, *ghosts], timeout_s=300)
        assert {rows[j]["status"] for j in [*posted, after]} == {"succeeded"}
        assert rows[long_job]["status"] == "cancelled" and rows[long_job]["completion_tokens"] < 2000
        assert {rows[g]["status"] for g in ghosts} == {"cancelled"}
        assert rows[bomb_id]["status"] == "rejected"
        assert f"offsets {bomb[0]}..{bomb[-1]}" in rows[bomb_id]["error"]
        assert job_rows(db, [f"{low}:0:{o}" for o in bomb[1:]]) == {}  # the batch was one record, not five

        read_topic(dep, dep.topics.dlq, since, lambda rs: len(rs) >= 2)
        time.sleep(2)
        dlq = [dict(r.headers) for r in read_topic(dep, dep.topics.dlq, since, lambda rs: False, timeout_s=3)]
        assert sorted((h["source_topic"].decode(), int(h["source_offset"])) for h in dlq) == sorted(
            [(dep.topics.control, control_bomb), (low, bomb[0])]
        )  # each bomb dead-lettered once
        control_error = next(h["error"] for h in dlq if h["source_topic"] == dep.topics.control.encode())
        assert b"cannot be decoded" in control_error and b"inflates past" in control_error
        assert {h["reason"] for h in dlq} == {b"invalid_control", b"undecodable"}
        assert set(results_by_job(dep, since, len(posted) + 3)) >= {*posted, long_job, after}
        assert worker.proc.poll() is None
