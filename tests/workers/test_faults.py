"""Faults on real services of their own (private Kafka and PostgreSQL, so nothing else is disturbed):
kill -9 of the broker or the database mid-generation, and of a worker at the worst moments of the outbox.
Each time: every job ends once, with one result, and the worker process rides it out."""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest
from sqlalchemy import create_engine, func, select

from schemas.tables import TERMINAL_STATUSES, jobs
from tests.services.factories import PrivateServices, make_private_services
from tests.workers.worker_factories import (
    job_rows,
    make_deployment,
    now_ms,
    read_topic,
    results_by_job,
    start_worker,
    token_events,
    wait_status,
    wait_terminal,
    wait_until,
)
from workers.client import JobClient

pytestmark = [pytest.mark.services, pytest.mark.slow]


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory):
    services = make_private_services(tmp_path_factory.mktemp("state"))
    services.cli("up")
    try:
        yield services
    finally:
        services.cli("down", "--purge", check=False)


@pytest.fixture
def deployment(private: PrivateServices, tmp_path):
    dep = make_deployment(private.settings)
    client = JobClient(dep)
    db = create_engine(dep.database_url, pool_pre_ping=True)
    try:
        yield dep, client, db, tmp_path
    finally:
        client.close()
        db.dispose()


def kill9(pid: int) -> None:
    proc = psutil.Process(pid)
    proc.kill()
    proc.wait(30)


def _submit(client: JobClient, prefix: str, n: int, max_tokens: int) -> list[str]:
    ids = [
        client.submit(
            {"job_id": f"{prefix}-{i}", "prompt": f"job {i} of {prefix}", "max_tokens": max_tokens},
            ("high", "normal", "low")[i % 3],
        ).job_id
        for i in range(n)
    ]
    client.flush()
    return ids


def _assert_once(dep, db, ids: list[str], since: int) -> dict[str, dict]:
    rows = wait_terminal(db, ids, timeout_s=300)
    assert {r["status"] for r in rows.values()} == {"succeeded"}, {k: r["status"] for k, r in rows.items()}
    results = results_by_job(dep, since, len(ids), settle_s=2.0)
    assert {job_id: len(rs) for job_id, rs in results.items() if job_id in rows} == dict.fromkeys(ids, 1)
    # published_at is set just after the broker acknowledged the result: allow it that moment
    wait_until(lambda: all(r["published_at"] is not None for r in job_rows(db, ids).values()), timeout_s=60)
    return rows


@pytest.mark.parametrize("service", ["kafka", "postgres"])
def test_service_killed_mid_generation_loses_nothing(private, deployment, service):
    dep, client, db, tmp = deployment
    worker = start_worker(dep, tmp, f"w-{service}")
    try:
        since = now_ms()
        ids = _submit(client, f"{service}-{dep.topic_prefix}", 24, 120)
        wait_status(db, ids[0], "running")
        kill9(private.status()[service]["pid"])
        time.sleep(3)  # the worker generates on, its writes and sends fail and are retried
        private.cli("up")
        rows = _assert_once(dep, db, ids, since)
        assert {r["worker_id"] for r in rows.values()} == {f"w-{service}"}
        assert all(r["completion_tokens"] == 120 for r in rows.values())
        _assert_streams_complete(dep, rows, since)  # the outage cost no token event
        assert worker.proc.poll() is None, worker.output()[-3000:]
        # and it still takes new work afterwards
        later = _submit(client, f"{service}-after-{dep.topic_prefix}", 3, 4)
        assert {r["status"] for r in wait_terminal(db, later).values()} == {"succeeded"}
    finally:
        assert worker.stop() == 0, worker.output()[-3000:]


@pytest.mark.parametrize("service", ["kafka", "postgres"])
def test_worker_started_while_a_service_is_down_waits_for_it(private, deployment, service):
    dep, client, db, tmp = deployment
    kill9(private.status()[service]["pid"])
    worker = start_worker(dep, tmp, f"w-early-{service}")
    try:
        # it gets as far as it can (Kafka: retrying its first connection; PostgreSQL: serving) and stays up
        waiting = "Kafka at" if service == "kafka" else "serving"
        wait_until(lambda: waiting in worker.output() or worker.proc.poll() is not None, timeout_s=120)
        time.sleep(2)
        assert worker.proc.poll() is None, worker.output()[-3000:]
        private.cli("up")
        ids = _submit(client, f"early-{service}-{dep.topic_prefix}", 3, 4)
        rows = wait_terminal(db, ids, timeout_s=180)
        assert {r["status"] for r in rows.values()} == {"succeeded"}
        assert {r["worker_id"] for r in rows.values()} == {f"w-early-{service}"}
    finally:
        private.cli("up")
        assert worker.stop() == 0, worker.output()[-3000:]


@pytest.mark.parametrize("failpoint", ["crash-before-publish", "crash-after-publish"])
def test_worker_killed_around_the_publish_still_yields_the_result(private, deployment, failpoint):
    dep, client, db, tmp = deployment
    victim = start_worker(dep, tmp, "w-victim", env={"INFERQ_FAILPOINT": failpoint})
    since = now_ms()
    [job_id] = _submit(client, f"{failpoint}-{dep.topic_prefix}", 1, 6)
    assert victim.proc.wait(120) == -signal.SIGKILL, victim.output()[-3000:]
    row = job_rows(db, [job_id])[job_id]
    assert row["status"] == "succeeded" and row["published_at"] is None  # committed, not marked published
    survivor = start_worker(dep, tmp, "w-survivor")
    try:
        wait_until(lambda: job_rows(db, [job_id])[job_id]["published_at"] is not None)
        # before the publish the survivor sends the result; after it (the broker has it, published_at
        # is not set yet) it finds the result in the topic and sends nothing: exactly one either way
        [result] = results_by_job(dep, since, 1, settle_s=2.0)[job_id]
        assert (result.status, result.output_text) == ("succeeded", row["output_text"])
        assert job_rows(db, [job_id])[job_id]["attempts"] == 1  # never run twice
    finally:
        assert survivor.stop() == 0, survivor.output()[-3000:]


def test_soak_with_a_worker_killed_and_the_broker_restarted(private, deployment):
    """2,000 jobs over three classes; one worker is killed -9 and the broker restarted along the way."""
    dep, client, db, tmp = deployment
    workers = [start_worker(dep, tmp, name) for name in ("w-soak-a", "w-soak-b")]
    try:
        since = now_ms()
        ids = _submit(client, f"soak-{dep.topic_prefix}", 2000, 8)
        wait_until(lambda: _terminal_count(db, ids) >= 400, timeout_s=300)
        workers[0].stop(signal.SIGKILL)
        workers.append(start_worker(dep, tmp, "w-soak-c"))
        wait_until(lambda: _terminal_count(db, ids) >= 1200, timeout_s=300)
        kill9(private.status()["kafka"]["pid"])
        time.sleep(3)
        private.cli("up")
        rows = _assert_once(dep, db, ids, since)
        assert set(rows) == set(ids)
        _assert_streams_complete(dep, rows, since)
        for w in workers[1:]:
            assert w.proc.poll() is None, (w.worker_id, w.output()[-6000:])
    finally:
        for w in workers:
            w.stop(signal.SIGTERM)


def _assert_streams_complete(dep, rows: dict[str, dict], since: int) -> None:
    """Each job's final attempt streamed every delta once, in order, ending with its finish reason."""
    records = read_topic(dep, dep.topics.tokens, since, _all_final(rows), timeout_s=120)
    events = token_events(records)
    for job_id, row in rows.items():
        final = [e for e in events.get(job_id, []) if e.attempt == row["attempts"]]
        assert [e.seq for e in final] == list(range(len(final))), (job_id, [e.seq for e in final])
        assert final and final[-1].finish_reason, (job_id, row["attempts"], len(events.get(job_id, [])))
        assert "".join(e.text for e in final) == row["output_text"], job_id


def _terminal_count(db, ids: list[str]) -> int:
    with db.connect() as conn:
        query = select(func.count()).where(jobs.c.job_id.in_(ids), jobs.c.status.in_(TERMINAL_STATUSES))
        return conn.execute(query).scalar_one()


def _all_final(rows: dict[str, dict]):
    """Until the last event of every job's final attempt is in (read incrementally: thousands of records)."""
    finished: set[str] = set()
    seen = 0

    def until(records) -> bool:
        nonlocal seen
        for r in records[seen:]:
            event = json.loads(r.value)
            row = rows.get(event["job_id"])
            if event["finish_reason"] and row is not None and event["attempt"] == row["attempts"]:
                finished.add(event["job_id"])
        seen = len(records)
        return len(finished) >= len(rows)

    return until
