"""Bulk maintenance and the producer's checkpoints against a real (scratch) PostgreSQL; no Kafka needed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, text

from schemas.tables import jobs
from tests.workers.bulk_factories import numbered_batch
from tests.workers.history_factories import insert_jobs, make_job, migrated_engine
from workers import naming
from workers.bulk import advance
from workers.bulk.batch_format import job_id_for
from workers.bulk.produce import produce
from workers.db import bulk_jobs as store
from workers.db import maintenance

pytestmark = pytest.mark.services

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


@pytest.fixture
def db(scratch_database):
    engine = migrated_engine(scratch_database)
    yield engine
    engine.dispose()


def statuses(db) -> dict[str, tuple[str, str | None]]:
    with db.connect() as conn:
        return {r.job_id: (r.status, r.worker_id) for r in conn.execute(select(jobs))}


def test_only_jobs_of_dead_workers_of_this_deployment_are_released(db):
    old = NOW - timedelta(minutes=5)
    running = {"status": "running", "finished_at": None, "updated_at": old, "source_topic": "inferq.jobs.low"}
    insert_jobs_at = [
        make_job("dead-running", worker_id="gone", **running),
        make_job("dead-queued", worker_id="gone", **{**running, "status": "queued"}),
        make_job("alive", worker_id="here", **running),
        make_job("dead-but-fresh", worker_id="gone", **{**running, "updated_at": NOW - timedelta(seconds=5)}),
        make_job("other-deployment", worker_id="gone", **{**running, "source_topic": "t123.jobs.low"}),
        make_job("finished", worker_id="gone", updated_at=old, source_topic="inferq.jobs.low"),
    ]
    with db.begin() as conn:
        insert_jobs(conn, insert_jobs_at)
        released = maintenance.release_dead_workers(conn, "inferq", {"here"}, NOW)
    assert sorted(released) == ["dead-queued", "dead-running"]
    after = statuses(db)
    assert after["dead-running"] == after["dead-queued"] == ("queued", None)
    assert after["alive"] == ("running", "here") and after["dead-but-fresh"] == ("running", "gone")
    assert after["other-deployment"] == ("running", "gone") and after["finished"] == ("succeeded", "gone")


def test_live_workers_are_read_from_client_ids():
    assert naming.live_worker_ids({"inferq-w1", "inferq-host-42", "something-else"}) == {"w1", "host-42"}


class CrashingSubmitter:
    """Stands in for JobClient: records what the 'broker' took, and fails a batch that would take it past
    `crash_after` jobs (as submit_many raises DeliveryFailed)."""

    def __init__(self, crash_after: int | None = None) -> None:
        self.crash_after, self.flushed = crash_after, []

    def submit_many(self, jobs, priority: str = "normal") -> list[str]:
        if self.crash_after is not None and len(self.flushed) + len(jobs) > self.crash_after:
            raise RuntimeError("crash")
        self.flushed += [(job.job_id, priority, job.bulk_id) for job in jobs]
        return [job.job_id for job in jobs]


def test_producer_resumes_from_its_last_checkpoint(db, tmp_path):
    path = numbered_batch(tmp_path / "in.jsonl", 1000)
    with db.begin() as conn:
        store.create(conn, "bk", input_path=str(path), total_lines=1000, priority="low",
                     metadata={"topic_prefix": "inferq"})  # fmt: skip
    first = CrashingSubmitter(crash_after=450)
    with pytest.raises(RuntimeError):
        produce(db, "bk", first, checkpoint=200)
    with db.connect() as conn:
        row = store.get(conn, "bk")
    assert (row["status"], row["submitted_lines"]) == ("submitting", 400)  # checkpoints at 200 and 400

    second = CrashingSubmitter()
    assert produce(db, "bk", second, checkpoint=200) == "running"
    expected = [job_id_for("bk", f"req-{i:04d}") for i in range(1000)]
    assert [j for j, _, _ in second.flushed] == expected[400:]  # nothing before the checkpoint again
    assert {j for j, _, _ in first.flushed} | {j for j, _, _ in second.flushed} == set(expected)
    assert {(p, b) for _, p, b in second.flushed} == {("low", "bk")}
    with db.connect() as conn:
        assert store.get(conn, "bk")["submitted_lines"] == 1000
        assert store.open_bulk_ids(conn, "inferq") == [("bk", "running")]
        assert store.open_bulk_ids(conn, "other") == []


def test_a_cancelled_bulk_job_is_not_produced_and_gets_its_files(db, tmp_path):
    path = numbered_batch(tmp_path / "in.jsonl", 3)
    with db.begin() as conn:
        store.create(conn, "bc", tenant="acme", input_path=str(path), total_lines=3,  # make_job's tenant
                     metadata={"topic_prefix": "inferq"})  # fmt: skip
        store.transition(conn, "bc", ("submitting",), "cancelled", finished_at=NOW)
        insert_jobs(conn, [make_job(job_id_for("bc", "req-0001"), bulk_id="bc")])
    assert produce(db, "bc", CrashingSubmitter()) == "cancelled"
    counts = advance.maybe_finalize(db, "bc", now=NOW)
    assert (counts.succeeded, counts.unfinished) == (1, 2)
    with db.connect() as conn:
        row = store.get(conn, "bc")
        assert row["status"] == "cancelled" and row["output_path"].endswith("output.jsonl")
        assert row["metadata"]["final"] == {"succeeded": 1, "failed": 0, "invalid": 0, "unfinished": 2}
        assert row["metadata"]["topic_prefix"] == "inferq"
        assert conn.execute(text("SELECT done FROM bulk_progress WHERE bulk_id = 'bc'")).scalar_one() == 1
    assert advance.maybe_finalize(db, "bc", now=NOW) is None  # written once


def make_bulk(db, bulk_id: str, path, prefix: str = "inferq") -> None:
    with db.begin() as conn:
        store.create(conn, bulk_id, input_path=str(path), total_lines=1, metadata={"topic_prefix": prefix})


def test_tick_restarts_a_producer_only_when_none_holds_the_bulk_job(db, tmp_path):
    make_bulk(db, "bt", numbered_batch(tmp_path / "in.jsonl", 1))
    make_bulk(db, "elsewhere", tmp_path / "in.jsonl", prefix="t-other")
    started: list[str] = []
    with store.bulk_lock(db, "bt") as got:  # a producer at work
        assert got
        advance.tick(db, "inferq", started.append)
    assert started == []
    advance.tick(db, "inferq", started.append)
    assert started == ["bt"]  # not "elsewhere": another deployment's bulk job


def test_a_missing_input_file_fails_the_bulk_job(db, tmp_path):
    make_bulk(db, "gone", tmp_path / "nothing.jsonl")
    assert produce(db, "gone", CrashingSubmitter()) == "failed"
    with db.connect() as conn:
        row = store.get(conn, "gone")
    assert row["status"] == "failed" and "not readable" in row["error"]
