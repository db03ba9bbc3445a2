"""Two worker processes in one consumer group: shared partitions, exactly-once results, crash recovery."""

from __future__ import annotations

import signal

import pytest
from sqlalchemy import create_engine

from schemas.jobs import JobResult
from tests.workers.worker_factories import (
    make_deployment,
    now_ms,
    read_topic,
    start_worker,
    wait_group_members,
    wait_terminal,
)
from workers.client import JobClient

pytestmark = [pytest.mark.services, pytest.mark.slow]


@pytest.fixture
def pair(settings, tmp_path):
    dep = make_deployment(settings)
    workers = [start_worker(dep, tmp_path, name) for name in ("w-a", "w-b")]
    client = JobClient(dep)
    db = create_engine(dep.database_url)
    try:
        wait_group_members(dep, 2)
        yield dep, client, db, workers
    finally:
        client.close()
        for w in workers:
            w.stop(signal.SIGTERM)
        db.dispose()


def _result_counts(dep, since: int, expected: int) -> dict[str, int]:
    records = read_topic(dep, dep.topics.results, since, lambda rs: len(rs) >= expected)
    records += read_topic(dep, dep.topics.results, since, lambda rs: False, timeout_s=2)[len(records) :]
    counts: dict[str, int] = {}
    for r in records:
        job_id = JobResult.model_validate_json(r.value).job_id
        counts[job_id] = counts.get(job_id, 0) + 1
    return counts


def test_two_workers_share_partitions_and_finish_every_job_once(pair):
    dep, client, db, workers = pair
    since = now_ms()
    ids = [
        client.submit(
            {"job_id": f"g-{dep.topic_prefix}-{i}", "prompt": f"shared {i}", "max_tokens": 6},
            ("high", "normal", "low")[i % 3],
        ).job_id
        for i in range(40)
    ]
    client.flush()
    rows = wait_terminal(db, ids)
    assert {r["status"] for r in rows.values()} == {"succeeded"}
    assert {r["worker_id"] for r in rows.values()} == {"w-a", "w-b"}
    assert _result_counts(dep, since, len(ids)) == {job_id: 1 for job_id in ids}
    assert all(w.proc.poll() is None for w in workers)


def test_killed_worker_jobs_complete_on_the_other(pair):
    dep, client, db, workers = pair
    since = now_ms()
    ids = [
        client.submit(
            {"job_id": f"k-{dep.topic_prefix}-{i}", "prompt": f"crash {i}", "max_tokens": 150}
        ).job_id
        for i in range(12)
    ]
    client.flush()
    victim = _first_running_worker(db, ids)
    victim_proc = next(w for w in workers if w.worker_id == victim)
    victim_proc.stop(signal.SIGKILL)
    rows = wait_terminal(db, ids, timeout_s=300)
    assert {r["status"] for r in rows.values()} == {"succeeded"}
    survivor = next(w.worker_id for w in workers if w.worker_id != victim)
    retried = [r for r in rows.values() if r["attempts"] == 2]
    assert retried, "the killed worker's jobs should have been redone"
    assert {r["worker_id"] for r in retried} == {survivor}
    assert all(r["completion_tokens"] == 150 for r in rows.values())
    assert _result_counts(dep, since, len(ids)) == {job_id: 1 for job_id in ids}


def _first_running_worker(db, ids: list[str]) -> str:
    import time

    from tests.workers.worker_factories import job_rows

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        running = [r for r in job_rows(db, ids).values() if r["status"] == "running"]
        if running:
            return running[0]["worker_id"]
        time.sleep(0.05)
    raise AssertionError("no job started running")
