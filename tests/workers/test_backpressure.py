"""Backpressure: with a tiny local queue, low partitions are paused and resumed until a backlog drains."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine

from tests.workers.worker_factories import make_deployment, start_worker, wait_group_members, wait_terminal
from workers.client import JobClient

pytestmark = [pytest.mark.services, pytest.mark.slow]


def test_a_paused_backlog_drains_completely_and_high_jobs_pass_it(settings, tmp_path):
    dep = make_deployment(settings)
    # few seats and a tiny queue keep the low partitions paused for seconds at a time
    worker = start_worker(dep, tmp_path, "w-pressure", "--max-waiting", "8", "--max-num-seqs", "4")
    db = create_engine(dep.database_url)
    try:
        wait_group_members(dep, 1)
        with JobClient(dep) as client:
            backlog = {"prompt": "x" * 30, "max_tokens": 24}
            ids = [f"bp-{dep.topic_prefix}-{i}" for i in range(160)]
            low = [
                s.job_id for s in client.submit_many([{**backlog, "job_id": job_id} for job_id in ids], "low")
            ]
            urgent = {"job_id": f"bp-high-{dep.topic_prefix}", "prompt": "urgent", "max_tokens": 2}
            high = client.submit(urgent, "high").job_id
        rows = wait_terminal(db, [*low, high], timeout_s=180)
        assert {r["status"] for r in rows.values()} == {"succeeded"}
        # the high job got in while the low partitions were paused, well before the backlog drained: the
        # low records buffered in the consumer neither kept its partition unfetched (kafka-python fetches
        # nothing while records are buffered) nor filled the room it needed (a poll brings every class)
        started_before = sorted(j for j in low if rows[j]["started_at"] < rows[high]["started_at"])
        assert len(started_before) < len(low) // 4, started_before
    finally:
        db.dispose()
        assert worker.stop() == 0, worker.output()[-3000:]


def test_a_backlog_of_high_jobs_stays_in_kafka_not_in_the_worker(settings, tmp_path):
    """Every class is capped: past twice --max-waiting jobs held here (waiting, or being admitted), high
    partitions pause too, so a backlog far larger than the cap never sits in one worker's memory."""
    dep = make_deployment(settings)
    worker = start_worker(dep, tmp_path, "w-cap", "--max-waiting", "8", "--max-num-seqs", "2")
    db = create_engine(dep.database_url)
    try:
        wait_group_members(dep, 1)
        with JobClient(dep) as client:
            jobs = [
                {"job_id": f"cap-{dep.topic_prefix}-{i}", "prompt": "x", "max_tokens": 8} for i in range(300)
            ]
            ids = [s.job_id for s in client.submit_many(jobs, "high")]
        rows = wait_terminal(db, ids, timeout_s=180)
        assert {r["status"] for r in rows.values()} == {"succeeded"}
    finally:
        db.dispose()
        assert worker.stop() == 0, worker.output()[-3000:]
    # the worker's own log, in its loop's order: jobs admitted and not started yet, at every moment
    held, most = 0, 0
    for line in worker.output().splitlines():
        if "job admitted cap-" in line:
            held += 1
            most = max(most, held)
        elif "job started cap-" in line:
            held -= 1
    assert 0 < most <= 2 * 8 + 4, most  # the cap, and what one poll may bring before its pause
