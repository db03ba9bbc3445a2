"""Jobs and cancels from a producer in another language: librdkafka (the C client kcat, franz-go's peers and
most non-Java services build on), through confluent-kafka's bundled build, compressing with each codec. The
worker must run or cancel every one of them, and jobs posted afterwards must run at once."""

from __future__ import annotations

import json

import kafka.record.default_records as default_records
import pytest
from confluent_kafka import Producer

from tests.workers.worker_factories import now_ms, read_topic, serving_worker, wait_status, wait_terminal
from workers.kafka_io.codec import install_bounds

pytestmark = [pytest.mark.services, pytest.mark.slow, pytest.mark.timeout(600)]

CODECS = ("gzip", "snappy", "lz4", "zstd")


def _post(settings, topic: str, codec: str, messages: list[tuple[str, dict]]) -> None:
    """`messages` (key, body) in one librdkafka batch compressed with `codec`; every delivery confirmed."""
    producer = Producer(
        {
            "bootstrap.servers": settings.kafka,
            "compression.type": codec,
            "linger.ms": 500,  # one batch for all of them
            "enable.idempotence": True,
        }
    )
    failures: list = []
    for key, body in messages:
        producer.produce(
            topic,
            key=key.encode(),
            value=json.dumps(body).encode(),
            on_delivery=lambda err, _msg: failures.append(err) if err else None,
        )
    assert producer.flush(60) == 0, "librdkafka could not deliver everything"
    assert not failures, failures


def _codecs_in(settings, reads: dict[str, int], since: int, monkeypatch) -> set[str]:
    """The codecs kafka-python decompresses while reading `reads` (topic: records) back: proof that
    librdkafka really compressed the batches (it may send a batch that would not shrink as it is)."""
    install_bounds()  # first: it replaces the decoders, and would replace the spies
    seen: set[str] = set()
    for codec in CODECS:
        real = getattr(default_records, f"{codec}_decode")

        def spy(payload, codec=codec, real=real):
            seen.add(codec)
            return real(payload)

        monkeypatch.setattr(default_records, f"{codec}_decode", spy)
    for topic, count in reads.items():
        read_topic(settings, topic, since, lambda rs, count=count: len(rs) >= count)
    return seen


def test_jobs_and_cancels_from_librdkafka_in_every_codec_run_and_later_jobs_run_at_once(
    settings, tmp_path, monkeypatch
):
    with serving_worker(settings, tmp_path, "w-foreign") as (dep, client, db, worker):
        p, since = dep.topic_prefix, now_ms()
        jobs, topics = [], []
        for n, codec in enumerate(CODECS):
            topic = dep.topics.jobs(("high", "normal", "low", "normal")[n])
            batch = [f"{codec}-{i}-{p}" for i in range(3)]
            _post(
                dep,
                topic,
                codec,
                [(j, {"job_id": j, "prompt": "foreign " * 30, "max_tokens": 3}) for j in batch],
            )
            jobs += batch
            topics.append(topic)

        # on the control topic: each codec's batch cancels one running job
        long_jobs = {
            c: client.submit({"job_id": f"long-{c}-{p}", "prompt": "go", "max_tokens": 4000}).job_id
            for c in CODECS
        }
        client.flush()
        for job_id in long_jobs.values():
            wait_status(db, job_id, "running", timeout_s=180)
        for codec, job_id in long_jobs.items():
            _post(
                dep,
                dep.topics.control,
                codec,
                [(job_id, {"type": "cancel", "job_id": job_id, "tenant": "default"})],
            )

        after = [
            client.submit({"job_id": f"after-{i}-{p}", "prompt": "plain", "max_tokens": 3}, "low").job_id
            for i in range(3)
        ]
        client.flush()
        rows = wait_terminal(db, [*jobs, *long_jobs.values(), *after], timeout_s=300)
        assert {rows[j]["status"] for j in [*jobs, *after]} == {"succeeded"}, {
            j: rows[j]["error"] for j in jobs
        }
        for job_id in long_jobs.values():
            assert rows[job_id]["status"] == "cancelled" and rows[job_id]["completion_tokens"] < 4000
        assert worker.proc.poll() is None

    job_reads = {t: 3 * topics.count(t) for t in topics}
    assert _codecs_in(dep, job_reads, since, monkeypatch) == set(CODECS)
    assert _codecs_in(dep, {dep.topics.control: len(CODECS)}, since, monkeypatch) == set(CODECS)
