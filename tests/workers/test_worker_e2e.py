"""One worker process against the real local Kafka and PostgreSQL: the contract, end to end."""

from __future__ import annotations

import dataclasses
import json
import random
import socket
import time
import urllib.request
from datetime import UTC, datetime, timedelta

import pytest

from gpu.engine import Engine, EngineRequest
from scheduler.types import SamplingParams
from tests.api.api_factories import cli, migrated_database
from tests.workers.persistence_factories import admit_jobs
from tests.workers.worker_factories import (
    job_rows,
    now_ms,
    read_topic,
    read_topic_to_end,
    results_by_job,
    serving_worker,
    token_events,
    wait_status,
    wait_terminal,
    wait_until,
)
from workers.db.jobs import Terminal, finish
from workers.db.outbox import claim

pytestmark = [pytest.mark.services, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deployment(settings, tmp_path_factory):
    """One worker on a database of this module's own: table-wide counts (unpublished results) are ours."""
    port = _free_port()
    tmp = tmp_path_factory.mktemp("worker")
    with (
        migrated_database(settings) as url,
        serving_worker(
            dataclasses.replace(settings, database_url=url), tmp, "w-e2e", "--metrics-port", str(port),
            "--log-format", "json",
        ) as deployed,
    ):  # fmt: skip
        deployed[3].metrics_port = port
        yield deployed


def test_jobs_across_classes_and_tenants_succeed_and_streams_match(deployment):
    dep, client, db, _ = deployment
    rng = random.Random(7)
    since = now_ms()
    jobs = {}
    for i in range(50):
        job_id = f"mix-{dep.topic_prefix}-{i}"
        prompt = f"job {i}: " + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(5, 60)))
        jobs[job_id] = {
            "job_id": job_id,
            "prompt": prompt,
            "tenant": f"tenant-{i % 3}",
            "max_tokens": rng.randint(2, 24),
        }
        client.submit(jobs[job_id], ("high", "normal", "low")[i % 3])
    client.flush()
    rows = wait_terminal(db, list(jobs))
    assert {r["status"] for r in rows.values()} == {"succeeded"}
    assert {r["priority"] for r in rows.values()} == {"high", "normal", "low"}

    records = read_topic(
        dep,
        dep.topics.tokens,
        since,
        lambda rs: sum(1 for r in rs if json.loads(r.value)["finish_reason"]) >= len(jobs),
    )
    events = token_events(records)
    engine = Engine.from_options(model="tiny")
    for job_id, job in jobs.items():
        row, evs = rows[job_id], events[job_id]
        assert [e.seq for e in evs] == list(range(len(evs)))
        assert "".join(e.text for e in evs) == row["output_text"]
        assert evs[-1].finish_reason == row["finish_reason"]
        streamed = [t for e in evs for t in e.token_ids]
        assert len(streamed) == row["completion_tokens"]
        assert row["finish_reason"] == "stop" or len(streamed) == job["max_tokens"]
        prompt_ids = tuple(engine.tokenizer.encode(job["prompt"]))
        assert row["prompt_tokens"] == len(prompt_ids)
        expected = engine.generate(
            [
                EngineRequest(
                    job_id, prompt_ids, SamplingParams(max_tokens=job["max_tokens"], ignore_eos=False)
                )
            ]
        )
        assert streamed == expected[job_id]
        assert row["ttft_ms"] > 0 and row["e2e_ms"] >= row["ttft_ms"] and row["attempts"] == 1
        assert row["started_at"] <= row["first_token_at"] <= row["finished_at"]


MALFORMED = {
    "not-json": b"this is not json",
    "not-utf8": b'{"prompt": "\xff\xfe"}',
    "not-object": b"[1, 2, 3]",
    "wrong-type": json.dumps({"job_id": "bad-type-{p}", "prompt": "x", "max_tokens": "many"}).encode(),
    "unknown-field": json.dumps({"job_id": "bad-field-{p}", "prompt": "x", "colour": "blue"}).encode(),
    "over-limit": json.dumps({"job_id": "bad-limit-{p}", "prompt": "x", "max_tokens": 10**6}).encode(),
    "both-inputs": json.dumps({"job_id": "bad-both-{p}", "prompt": "x", "messages": []}).encode(),
    "too-long": json.dumps({"job_id": "bad-long-{p}", "prompt": "y" * 5000}).encode(),
}


def test_malformed_messages_go_to_dlq_and_rejected_rows(deployment):
    dep, client, db, worker = deployment
    since = now_ms()
    for name, value in MALFORMED.items():
        client.submit_raw(value.replace(b"{p}", dep.topic_prefix.encode()), "normal", key=name)
    good = client.submit(
        {"job_id": f"after-bad-{dep.topic_prefix}", "prompt": "still serving", "max_tokens": 3}
    ).job_id
    client.flush()
    dlq = read_topic(dep, dep.topics.dlq, since, lambda rs: len(rs) >= len(MALFORMED))
    assert sorted(r.key.decode() for r in dlq) == sorted(MALFORMED)
    for r in dlq:
        headers = dict(r.headers)
        assert headers["source_topic"].decode() == dep.topics.jobs("normal")
        assert int(headers["source_offset"]) >= 0 and headers["error"]
        assert r.value == MALFORMED[r.key.decode()].replace(b"{p}", dep.topic_prefix.encode())
    named = {f"bad-{k}-{dep.topic_prefix}" for k in ("type", "field", "limit", "both", "long")}
    rows = wait_terminal(db, sorted(named) + [good])
    assert rows[good]["status"] == "succeeded"
    for job_id in named:
        assert rows[job_id]["status"] == "rejected" and rows[job_id]["error"], rows[job_id]
    assert "max_tokens" in rows[f"bad-type-{dep.topic_prefix}"]["error"]
    assert "colour" in rows[f"bad-field-{dep.topic_prefix}"]["error"]
    assert "context" in rows[f"bad-long-{dep.topic_prefix}"]["error"]
    # messages without a readable job_id get one derived from topic:partition:offset
    unnamed = [dict(r.headers) for r in dlq if r.key.decode() in ("not-json", "not-utf8", "not-object")]
    derived = [
        f"{dep.topics.jobs('normal')}:{h['source_partition'].decode()}:{h['source_offset'].decode()}"
        for h in unnamed
    ]
    derived_rows = job_rows(db, derived)
    assert len(derived_rows) == 3 and {row["status"] for row in derived_rows.values()} == {"rejected"}
    assert worker.proc.poll() is None


def test_cancel_and_timeout(deployment):
    dep, client, db, _ = deployment
    long_job = client.submit(
        {"job_id": f"cancel-{dep.topic_prefix}", "prompt": "go on", "max_tokens": 2000}
    ).job_id
    client.flush()
    wait_status(db, long_job, "running")
    client.cancel(long_job)
    expired = client.submit(
        {"job_id": f"expire-{dep.topic_prefix}", "prompt": "late", "max_tokens": 2000, "timeout_s": 0.5}
    ).job_id
    client.flush()
    rows = wait_terminal(db, [long_job, expired])
    assert rows[long_job]["status"] == "cancelled"
    assert rows[long_job]["completion_tokens"] < 2000
    assert rows[expired]["status"] == "expired"
    pre = f"precancel-{dep.topic_prefix}"
    client.cancel(pre)  # cancelled before it is ever posted: the job must never run
    wait_status(db, pre, "cancelled")
    sent = client.submit({"job_id": pre, "prompt": "never", "max_tokens": 5})
    client.flush()
    # the worker is done with the record once its group's committed offset passes it
    from kafka import KafkaAdminClient, TopicPartition

    from workers.naming import worker_group

    with KafkaAdminClient(**dep.kafka_connection.client_options(), client_id="inferq-test") as admin:
        where = TopicPartition(sent.topic, sent.partition)

        def committed() -> int:
            group = worker_group(dep.topic_prefix)
            offsets = admin.list_group_offsets({group: [where]})[group]
            return offsets[where].offset if where in offsets else -1

        wait_until(lambda: committed() > sent.offset, timeout_s=60)
    row = job_rows(db, [pre])[pre]
    assert (row["status"], row["started_at"], row["completion_tokens"]) == ("cancelled", None, None)


def test_duplicates_and_redeliveries_yield_one_terminal_row_and_result(deployment):
    dep, client, db, _ = deployment
    since = now_ms()
    job = {"job_id": f"dup-{dep.topic_prefix}", "prompt": "only once", "max_tokens": 8}
    client.submit(job, "normal")
    client.submit(job, "high")  # same job on another class, in flight together
    client.flush()
    wait_terminal(db, [job["job_id"]])
    # the row is final once its result is out (published_at set after the publish)
    wait_until(lambda: job_rows(db, [job["job_id"]])[job["job_id"]]["published_at"] is not None)
    rows = job_rows(db, [job["job_id"]])
    client.submit(job, "low")  # a redelivery of a finished job
    probe = client.submit(
        {"job_id": f"probe-{dep.topic_prefix}", "prompt": "after", "max_tokens": 2}, "low"
    ).job_id
    client.flush()
    wait_terminal(db, [probe])
    results = results_by_job(dep, since, 2)
    assert len(results[job["job_id"]]) == 1
    assert job_rows(db, [job["job_id"]])[job["job_id"]] == rows[job["job_id"]]


def test_results_and_token_events_carry_the_jobs_headers(deployment):
    dep, client, db, _ = deployment
    since = now_ms()
    job_id = client.submit(
        {"job_id": f"headers-{dep.topic_prefix}", "tenant": "acme", "prompt": "tag me", "max_tokens": 6}
    ).job_id
    client.flush()
    wait_terminal(db, [job_id])
    key = job_id.encode()
    results = read_topic(dep, dep.topics.results, since, lambda rs: any(r.key == key for r in rs))
    tokens = read_topic(
        dep,
        dep.topics.tokens,
        since,
        lambda rs: any(r.key == key and json.loads(r.value)["finish_reason"] for r in rs),
    )
    ours = [r for r in results + tokens if r.key == key]
    assert len(ours) >= 2
    assert {r.headers for r in ours} == {(("job_id", key), ("attempt", b"1"), ("tenant", b"acme"))}


def test_a_job_not_streamed_has_its_result_and_no_token_events(deployment):
    dep, client, db, _ = deployment
    since = now_ms()
    quiet, streamed = f"quiet-{dep.topic_prefix}", f"loud-{dep.topic_prefix}"
    client.submit({"job_id": quiet, "prompt": "no stream", "max_tokens": 6, "stream": False})
    client.submit({"job_id": streamed, "prompt": "a stream", "max_tokens": 6})
    client.flush()
    wait_terminal(db, [quiet, streamed])
    results = results_by_job(dep, since, 2)
    assert [r.status for r in results[quiet]] == ["succeeded"] and results[quiet][
        0
    ].usage.completion_tokens == 6
    final = lambda rs: any(r.key == streamed.encode() and json.loads(r.value)["usage"] for r in rs)  # noqa: E731
    by_job = token_events(read_topic(dep, dep.topics.tokens, since, final))
    assert "".join(e.text for e in by_job[streamed]) == results[streamed][0].output_text
    # every partition read to its end (the quiet job's may not have been read above)
    everything = token_events(read_topic_to_end(dep, dep.topics.tokens, since))
    assert streamed in everything and quiet not in everything
    told = cli(dep, "tail", quiet, "--timeout", "5")  # says so at once rather than wait for nothing
    assert told.returncode == 1 and "not streamed" in told.stderr


def test_a_result_nobody_publishes_goes_out_without_a_redelivery(deployment):
    """A terminal row left unpublished by a worker that is gone, whose record will never be read again:
    the worker's sweeper publishes its result."""
    dep, _, db, _ = deployment
    since = now_ms()
    job_id = f"orphan-{dep.topic_prefix}"
    admit_jobs(dep, db, "w-gone", {job_id: 10**9})  # an offset no record has: nothing is redelivered
    now = datetime.now(UTC)
    values = {"output_text": "left behind", "finish_reason": "stop", "finished_at": now}
    with db.begin() as conn:  # written by w-gone, whose lease lapsed long ago
        finish(
            conn,
            Terminal(
                job_id, "succeeded", {**values, **claim("w-gone", now - timedelta(hours=1))}, tenant="t-a"
            ),
            now,
        )
    wait_until(lambda: job_rows(db, [job_id])[job_id]["published_at"] is not None, timeout_s=60)
    assert job_rows(db, [job_id])[job_id]["publisher"] == "w-e2e"
    [result] = results_by_job(dep, since, 1)[job_id]
    assert (result.status, result.output_text, result.worker_id) == ("succeeded", "left behind", "w-gone")


def test_metrics_endpoint_counts_what_happened(deployment):
    from workers.db.outbox import mark_published

    dep, client, db, worker = deployment
    job_id = client.submit(
        {"job_id": f"metrics-{dep.topic_prefix}", "prompt": "count me", "max_tokens": 4}
    ).job_id
    client.flush()
    wait_terminal(db, [job_id])

    def scrape() -> dict[str, float]:
        url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        return {
            name: float(value)
            for name, value in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
        }

    def lags(samples: dict[str, float]) -> list[float]:
        return [v for k, v in samples.items() if k.startswith("inferq:consumer_lag{")]

    def at_rest() -> bool:
        s = scrape()
        waiting = (s["inferq:persister_queue_depth"], s["inferq:persister_oldest_age_seconds"])
        return waiting == (0, 0) and len(lags(s)) == 13 and set(lags(s)) == {0}  # 3 x 4 partitions + control

    # every record read and every write done: the gauges say so (they are refreshed each second)
    wait_until(at_rest, timeout_s=30)
    # a terminal row another live publisher holds is counted unpublished (the count covers the whole
    # table, this module's own, every other result published; it is taken every 30 s): it alone, then none
    held = f"held-{dep.topic_prefix}"
    admit_jobs(dep, db, "w-held", {held: 10**9})
    now = datetime.now(UTC)
    values = {"output_text": "held", "finish_reason": "stop", "finished_at": now}
    with db.begin() as conn:  # its lease runs for an hour: no sweeper takes it meanwhile
        lease = claim("w-held", now + timedelta(hours=1))
        finish(conn, Terminal(held, "succeeded", {**values, **lease}, tenant="t-a"), now)
    try:
        wait_until(lambda: scrape()["inferq:unpublished_results"] == 1, timeout_s=90)
    finally:
        with db.begin() as conn:
            mark_published(conn, [("t-a", held)], "w-held", now)
    wait_until(lambda: scrape()["inferq:unpublished_results"] == 0, timeout_s=90)
    samples = scrape()
    model = 'model_name="tiny"'  # --model tiny, no --served-model-name: the spec is the name
    success = [k for k in samples if k.startswith("inferq:request_success_total{finished_reason=")]
    assert any(model in k and 'status="succeeded"' in k and samples[k] >= 1 for k in success), success
    assert samples[f'inferq:time_to_first_token_seconds_count{{{model},priority="normal"}}'] >= 1
    assert samples[f'inferq:inter_token_latency_seconds_count{{{model},priority="normal"}}'] >= 3  # 4 tokens
    assert samples[f"inferq:generation_tokens_total{{{model}}}"] >= 4
    assert (
        samples[f"inferq:prefix_cache_queries_total{{{model}}}"]
        >= samples[f"inferq:prefix_cache_hits_total{{{model}}}"]
    )
    assert (
        f"inferq:kv_cache_usage_perc{{{model}}}" in samples
        and f"inferq:num_requests_running{{{model}}}" in samples
    )
    # the malformed-message test ran first in this module: its records are counted by reason
    assert samples['inferq:requests_rejected_total{reason="invalid"}'] >= 7
    assert samples['inferq:requests_rejected_total{reason="too_long"}'] >= 1


def test_json_logs_carry_every_event_of_a_job_and_never_its_text(deployment):
    dep, client, db, worker = deployment
    secret = f"do-not-log-{dep.topic_prefix}"
    job_id = client.submit(
        {"job_id": f"logged-{dep.topic_prefix}", "prompt": secret, "max_tokens": 6}, "high"
    ).job_id
    client.submit_raw(b'{"job_id": "bad-log-%s", "max_tokens": "many"}' % dep.topic_prefix.encode(), "low")
    client.flush()
    row = wait_terminal(db, [job_id])[job_id]
    wait_terminal(db, [f"bad-log-{dep.topic_prefix}"])
    time.sleep(0.5)  # the log line of the rejection may trail its row by a moment
    lines = [ln for ln in worker.output().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message", "worker_id"} <= r.keys() for r in records)
    assert {r["worker_id"] for r in records} == {"w-e2e"}
    events = [r for r in records if r.get("job_id") == job_id]
    assert [e["event"] for e in events] == ["admitted", "started", "first_token", "finished"]
    assert {(e["level"], e["priority"]) for e in events} == {("INFO", "high")}
    finished = events[-1]
    assert finished["status"] == row["status"] == "succeeded"
    assert finished["finish_reason"] == row["finish_reason"]
    assert finished["completion_tokens"] == row["completion_tokens"] > 0
    assert finished["e2e_ms"] >= finished["ttft_ms"] >= 0
    rejected = [r for r in records if r.get("job_id") == f"bad-log-{dep.topic_prefix}"]
    assert [(r["event"], r["reason"], r["priority"]) for r in rejected] == [("rejected", "invalid", "low")]
    assert "max_tokens" in rejected[0]["error"]
    assert secret not in worker.output()
