"""Records that pass as JSON (or not even that) but would break a later stage: each one is rejected with a
reason, dead-lettered, and the worker serves the next job as if nothing happened."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import psutil
import pytest
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic
from sqlalchemy import create_engine

from schemas.tables import TERMINAL_STATUSES
from schemas.topics import PRIORITY_CLASSES
from tests.workers.worker_factories import (
    job_rows,
    make_deployment,
    now_ms,
    read_topic,
    results_by_job,
    serving_worker,
    start_worker,
    wait_group_members,
    wait_terminal,
)
from workers.client import JobClient
from workers.services.kafka import ensure_topics

pytestmark = [pytest.mark.services, pytest.mark.slow]


def _deep(levels: int) -> str:
    return '{"a":' * levels + "1" + "}" * levels


# name -> (raw value with {p} for the topic prefix, words the rejection reason must contain)
POISON = {
    "nul-prompt": (json.dumps({"job_id": "p-nul-{p}", "prompt": "nul \u0000 inside"}), "NUL"),
    "nul-chat": (
        json.dumps({"job_id": "p-nulchat-{p}", "messages": [{"role": "user", "content": "a\u0000b"}]}),
        "NUL",
    ),
    "nul-metadata-key": (
        json.dumps({"job_id": "p-nulkey-{p}", "prompt": "x", "metadata": {"a\u0000": 1}}),
        "NUL",
    ),
    "nul-stop": (json.dumps({"job_id": "p-nulstop-{p}", "prompt": "x", "stop": ["\u0000"]}), "NUL"),
    # json.dumps writes the escape `\ud800`, which decodes to a lone surrogate no statement can carry
    "surrogate-prompt": (json.dumps({"job_id": "p-sur-{p}", "prompt": "a\ud800b"}), "lone surrogate"),
    "surrogate-metadata": (
        json.dumps({"job_id": "p-surmeta-{p}", "prompt": "x", "metadata": {"k": ["\udfff"]}}),
        "lone surrogate",
    ),
    "infinite-timeout": ('{"job_id": "p-inf-{p}", "prompt": "x", "timeout_s": Infinity}', "finite"),
    "huge-timeout": (json.dumps({"job_id": "p-huge-{p}", "prompt": "x", "timeout_s": 1e15}), "timeout_s"),
    "overflow-timeout": ('{"job_id": "p-ovf-{p}", "prompt": "x", "timeout_s": 1e999}', "timeout_s"),
    "nan-temperature": ('{"job_id": "p-nan-{p}", "prompt": "x", "temperature": NaN}', "finite"),
    "huge-top-k": (json.dumps({"job_id": "p-topk-{p}", "prompt": "x", "top_k": 10**12}), "top_k"),
    "huge-seed": (json.dumps({"job_id": "p-seed-{p}", "prompt": "x", "seed": 2**70}), "seed"),
    "giant-integer": ('{"job_id": "p-int-{p}", "prompt": "x", "seed": ' + "9" * 5000 + "}", "JSON"),
    "deep-nesting": ('{"job_id": "p-deep-{p}", "prompt": "x", "metadata": ' + _deep(5000) + "}", "nested"),
    "deep-but-parsable": (
        '{"job_id": "p-deep2-{p}", "prompt": "x", "metadata": ' + _deep(40) + "}",
        "nested",
    ),
}


@pytest.fixture(scope="module")
def deployment(settings, tmp_path_factory):
    with serving_worker(settings, tmp_path_factory.mktemp("worker"), "w-poison") as deployed:
        yield deployed


def test_poison_records_are_rejected_and_the_worker_keeps_serving(deployment):
    dep, client, db, worker = deployment
    since = now_ms()
    before = client.submit(
        {"job_id": f"before-{dep.topic_prefix}", "prompt": "first", "max_tokens": 4}
    ).job_id
    for name, (value, _) in POISON.items():
        client.submit_raw(value.replace("{p}", dep.topic_prefix).encode(), "normal", key=name)
    after = client.submit(
        {"job_id": f"after-{dep.topic_prefix}", "prompt": "still here", "max_tokens": 4}
    ).job_id
    client.flush()
    ids = {
        name: json.loads(_parsable(v))["job_id"].replace("{p}", dep.topic_prefix)
        for name, (v, _) in POISON.items()
    }
    rows = wait_terminal(db, [before, after, *ids.values()], timeout_s=120)
    assert rows[before]["status"] == rows[after]["status"] == "succeeded"
    for name, (_, reason) in POISON.items():
        row = rows[ids[name]]
        assert row["status"] == "rejected", (name, row)
        assert reason in row["error"], (name, row["error"])
        assert "\x00" not in (row["prompt"] or "")
    dlq = read_topic(dep, dep.topics.dlq, since, lambda rs: len(rs) >= len(POISON))
    assert sorted(r.key.decode() for r in dlq) == sorted(POISON)
    assert all(dict(r.headers)["reason"] == b"invalid" for r in dlq)
    assert worker.proc.poll() is None


def _parsable(value: str) -> str:
    """The job_id of a poison value, read without tripping over what makes it poison."""
    start = value.index('"job_id": "') + len('"job_id": "')
    return json.dumps({"job_id": value[start : value.index('"', start)]})


def test_compressed_giants_are_bounded_and_dead_lettered_truncated(deployment):
    dep, client, db, worker = deployment
    since = now_ms()
    producer = KafkaProducer(
        bootstrap_servers=dep.kafka,
        compression_type="gzip",
        max_request_size=200 * 2**20,
    )
    try:
        big = json.dumps({"job_id": f"gz-big-{dep.topic_prefix}", "prompt": "z" * 10_000_000}).encode()
        producer.send(dep.topics.jobs("low"), key=b"gz-big", value=big).get(60)
        # inflates past the worker's 64 MiB bound: never decompressed whole, stepped over as undecodable
        bomb = b'{"prompt": "' + b"0" * (80 * 2**20) + b'"}'
        meta = producer.send(dep.topics.jobs("low"), key=b"gz-bomb", value=bomb).get(60)
    finally:
        producer.close()
    del bomb
    after = client.submit(
        {"job_id": f"after-gz-{dep.topic_prefix}", "prompt": "fine", "max_tokens": 3}, "low"
    ).job_id
    client.flush()
    bomb_id = f"{dep.topics.jobs('low')}:{meta.partition}:{meta.offset}"
    rows = wait_terminal(db, [f"gz-big-{dep.topic_prefix}", bomb_id, after], timeout_s=120)
    assert rows[after]["status"] == "succeeded"
    assert rows[f"gz-big-{dep.topic_prefix}"]["status"] == "rejected"
    assert "limit is 1000000" in rows[f"gz-big-{dep.topic_prefix}"]["error"]
    assert rows[bomb_id]["status"] == "rejected" and "cannot be decoded" in rows[bomb_id]["error"]
    dlq = {r.key: r for r in read_topic(dep, dep.topics.dlq, since, lambda rs: len(rs) >= 2)}
    headers = dict(dlq[b"gz-big"].headers)
    assert headers["original_size"] == str(len(big)).encode() and headers["truncated"] == b"true"
    assert 0 < len(dlq[b"gz-big"].value) < 1_000_000 and big.startswith(dlq[b"gz-big"].value)
    assert dict(dlq[None].headers)["reason"] == b"undecodable"
    assert worker.proc.poll() is None
    assert job_rows(db, [after])[after]["worker_id"] == "w-poison"


def test_a_step_that_raises_fails_the_jobs_in_the_engine_and_the_worker_goes_on(settings, tmp_path):
    """A record that breaks the engine itself (here by failpoint) must not crash-loop the group: the jobs of
    that step end `failed` with the reason, once each, and the worker serves the next job."""
    env = {"INFERQ_FAILPOINT": "step-error"}
    with serving_worker(settings, tmp_path, "w-step-error", env=env) as (dep, client, db, worker):
        since = now_ms()
        bystander = client.submit({"job_id": f"by-{dep.topic_prefix}", "prompt": "long", "max_tokens": 2000})
        poison = client.submit({"job_id": f"poison-{dep.topic_prefix}", "prompt": "a step-error here"})
        client.flush()
        rows = wait_terminal(db, [bystander.job_id, poison.job_id], timeout_s=120)
        assert rows[poison.job_id]["status"] == "failed"
        assert "engine step failed" in rows[poison.job_id]["error"], rows[poison.job_id]
        assert rows[poison.job_id]["finish_reason"] == "error"
        # the bystander either finished before the poison arrived, or shared its step and failed with it
        by = rows[bystander.job_id]
        assert by["status"] == "succeeded" or "engine step failed" in by["error"], by
        after = client.submit({"job_id": f"after-{dep.topic_prefix}", "prompt": "fine", "max_tokens": 4})
        client.flush()
        assert wait_terminal(db, [after.job_id])[after.job_id]["status"] == "succeeded"
        results = results_by_job(dep, since, 3, settle_s=2.0)
        assert {k: len(v) for k, v in results.items()} == {
            r: 1 for r in (bystander.job_id, poison.job_id, after.job_id)
        }
        assert results[poison.job_id][0].status == "failed"
        assert worker.proc.poll() is None


def test_timestamps_past_year_9999_are_not_believed_and_the_worker_keeps_serving(settings, tmp_path):
    """A producer's clock (or an attacker) may stamp a record with any time a topic accepts: past year 9999,
    or close enough that adding the deadline overflows. The job runs as if posted now."""
    dep = dataclasses.replace(settings, topic_prefix=f"ts{uuid.uuid4().hex[:10]}")
    far_future = {"message.timestamp.after.max.ms": str(2**63 - 1)}  # a topic that takes any timestamp
    with KafkaAdminClient(**dep.kafka_connection.client_options(), client_id="inferq-test") as admin:
        admin.create_topics(
            [NewTopic(dep.topics.jobs(c), 1, 1, topic_configs=far_future) for c in PRIORITY_CLASSES]
        )
    ensure_topics(dep.kafka_connection, dep.topic_partitions(), dep.replication_factor)
    worker = start_worker(dep, tmp_path, "w-timestamps")
    client, db = JobClient(dep), create_engine(dep.database_url)
    producer = KafkaProducer(bootstrap_servers=dep.kafka)
    try:
        stamps = {"past-9999": 253402300800000 + 5, "near-9999": 253402300799000 - 86_400_000}
        for name, ts in stamps.items():
            job = {
                "job_id": f"{name}-{dep.topic_prefix}",
                "prompt": "x",
                "max_tokens": 3,
                "timeout_s": 604800,
            }
            producer.send(dep.topics.jobs("normal"), json.dumps(job).encode(), timestamp_ms=ts).get(30)
        after = client.submit({"job_id": f"after-ts-{dep.topic_prefix}", "prompt": "y", "max_tokens": 3})
        client.flush()
        ids = [f"{name}-{dep.topic_prefix}" for name in stamps] + [after.job_id]
        rows = wait_terminal(db, ids, timeout_s=120)
        assert {rows[i]["status"] for i in ids} == {"succeeded"}, rows
        for name in stamps:
            assert rows[f"{name}-{dep.topic_prefix}"]["created_at"].year < 9999
        assert worker.proc.poll() is None
    finally:
        producer.close()
        client.close()
        db.dispose()
        assert worker.stop() == 0, worker.output()[-3000:]


def test_a_poison_request_is_found_alone_and_its_step_mates_finish(settings, tmp_path):
    """A step that raises fails no one at once: its sequences run alone until the one at fault fails by
    itself while the others' steps go through; only that job ends `failed`."""
    env = {"INFERQ_FAILPOINT": "step-error"}
    with serving_worker(settings, tmp_path, "w-isolate", env=env) as (dep, client, db, worker):
        mates = [
            client.submit({"job_id": f"mate{i}-{dep.topic_prefix}", "prompt": f"mate {i}", "max_tokens": 200})
            for i in range(3)
        ]
        poison = client.submit({"job_id": f"poison-{dep.topic_prefix}", "prompt": "a step-error here"})
        client.flush()
        rows = wait_terminal(db, [m.job_id for m in mates] + [poison.job_id], timeout_s=120)
        assert {rows[m.job_id]["status"] for m in mates} == {"succeeded"}, rows
        assert rows[poison.job_id]["status"] == "failed"
        assert "engine step failed" in rows[poison.job_id]["error"]
        assert worker.proc.poll() is None


def _submit_long_jobs(client: JobClient, dep, tag: str, max_tokens: int) -> list[str]:
    jobs = [
        {"job_id": f"{tag}{i}-{dep.topic_prefix}", "prompt": f"job {i}", "max_tokens": max_tokens}
        for i in range(6)
    ]
    return [s.job_id for s in client.submit_many(jobs)]


def _all_succeed_on_a_fresh_worker(dep, db, tmp_path, ids: list[str]) -> None:
    fresh = start_worker(dep, tmp_path, "w-fresh")
    try:
        rows = wait_terminal(db, ids, timeout_s=180)
        assert {r["status"] for r in rows.values()} == {"succeeded"}, rows
        assert {r["worker_id"] for r in rows.values()} == {"w-fresh"}
    finally:
        assert fresh.stop() == 0, fresh.output()[-3000:]


def test_a_device_that_fails_every_step_makes_the_worker_exit_and_another_redoes_its_jobs(settings, tmp_path):
    """Steps that keep failing whoever runs them are the device's fault: the worker exits non-zero within a
    few steps, writes no row for the jobs it held, and a fresh worker finishes every one of them."""
    dep = make_deployment(settings)
    broken = start_worker(dep, tmp_path, "w-broken", env={"INFERQ_FAILPOINT": "device-fault"})
    client, db = JobClient(dep), create_engine(dep.database_url)
    try:
        wait_group_members(dep, 1)
        ids = _submit_long_jobs(client, dep, "dev", 300)
        trigger = client.submit(
            {"job_id": f"trigger-{dep.topic_prefix}", "prompt": "device-fault now"}
        ).job_id
        client.flush()
        assert broken.proc.wait(120) == 3, broken.output()[-3000:]
        assert "engine steps in a row failed" in broken.output()
        assert not [r for r in job_rows(db, [*ids, trigger]).values() if r["status"] == "failed"]
        _all_succeed_on_a_fresh_worker(dep, db, tmp_path, [*ids, trigger])
    finally:
        client.close()
        db.dispose()
        broken.stop()


def test_a_worker_whose_engine_process_dies_exits_and_another_redoes_its_jobs(settings, tmp_path):
    """The engine runs in a child process; killed (as the kernel's OOM killer would), the worker exits 3
    without ending any job, and a fresh worker finishes every one of them."""
    dep = make_deployment(settings)
    orphaned = start_worker(dep, tmp_path, "w-orphaned")
    client, db = JobClient(dep), create_engine(dep.database_url)
    try:
        wait_group_members(dep, 1)
        ids = _submit_long_jobs(client, dep, "eng", 400)
        deadline = time.monotonic() + 60
        while not [r for r in job_rows(db, ids).values() if r["status"] == "running"]:
            assert time.monotonic() < deadline, "no job started"
            time.sleep(0.1)
        (engine,) = [
            c for c in psutil.Process(orphaned.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())
        ]
        engine.kill()
        assert orphaned.proc.wait(60) == 3, orphaned.output()[-3000:]
        assert "the engine process exited" in orphaned.output()
        assert not [r for r in job_rows(db, ids).values() if r["status"] in TERMINAL_STATUSES]
        _all_succeed_on_a_fresh_worker(dep, db, tmp_path, ids)
    finally:
        client.close()
        db.dispose()
        orphaned.stop()
