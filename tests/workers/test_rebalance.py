"""A fleet that grows and shrinks while long jobs run: nothing is stranded, nothing runs to two results."""

from __future__ import annotations

import signal
import time

import pytest
from sqlalchemy import create_engine

from tests.workers.worker_factories import (
    job_rows,
    make_deployment,
    now_ms,
    results_by_job,
    start_worker,
    wait_group_members,
    wait_terminal,
)
from workers.client import JobClient

pytestmark = [pytest.mark.services, pytest.mark.slow]


def test_workers_joining_and_leaving_mid_generation_strand_nothing(settings, tmp_path):
    dep = make_deployment(settings)
    client = JobClient(dep)
    db = create_engine(dep.database_url)
    workers = [start_worker(dep, tmp_path, "w-first")]
    try:
        wait_group_members(dep, 1)
        since = now_ms()
        ids = [
            client.submit(
                {"job_id": f"rb-{dep.topic_prefix}-{i}", "prompt": f"long job {i}", "max_tokens": 1200},
                ("high", "normal", "low")[i % 3],
            ).job_id
            for i in range(24)
        ]
        client.flush()
        _wait_running(db, ids, at_least=16)
        workers += [start_worker(dep, tmp_path, name) for name in ("w-second", "w-third")]
        wait_group_members(dep, 3)
        assert workers[1].stop(signal.SIGTERM) == 0, workers[1].output()[-3000:]
        rows = wait_terminal(db, ids, timeout_s=600)
        assert {r["status"] for r in rows.values()} == {"succeeded"}
        assert all(r["completion_tokens"] == 1200 for r in rows.values())
        results = results_by_job(dep, since, len(ids), settle_s=2.0)
        assert {job_id: len(results.get(job_id, [])) for job_id in ids} == dict.fromkeys(ids, 1)
        # cooperative rebalancing: the partitions the first worker kept went on running without a restart
        kept = [r for r in rows.values() if r["worker_id"] == "w-first" and r["attempts"] == 1]
        assert kept, {r["job_id"]: (r["worker_id"], r["attempts"]) for r in rows.values()}
        assert all(w.proc.poll() is None for w in (workers[0], workers[2]))
    finally:
        client.close()
        for w in workers:
            w.stop(signal.SIGTERM)
        db.dispose()


def _wait_running(db, ids: list[str], at_least: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(r["status"] == "running" for r in job_rows(db, ids).values()) < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"fewer than {at_least} jobs running after {timeout_s}s")
        time.sleep(0.1)
