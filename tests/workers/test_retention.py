"""History retention: its own command and setting, never a side effect of running a bulk worker."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from schemas.tables import bulk_jobs, jobs
from tests.services.factories import run_cli
from tests.workers.history_factories import insert_jobs, make_job, migrated_engine
from workers.bulk.tasks import maintain
from workers.db import retention

pytestmark = pytest.mark.services


@pytest.fixture
def db(scratch_database):
    engine = migrated_engine(scratch_database)
    yield engine
    engine.dispose()


def remaining(db) -> list[str]:
    with db.connect() as conn:
        return sorted(r.job_id for r in conn.execute(select(jobs.c.job_id)))


def add_history(db, now: datetime, tmp_path) -> None:
    """Two jobs past a 30-day retention, three that must stay (running, recent, of an open bulk job)."""
    old = now - timedelta(days=40)
    with db.begin() as conn:
        conn.execute(bulk_jobs.insert().values(bulk_id="old-done", status="completed", finished_at=old))
        conn.execute(bulk_jobs.insert().values(bulk_id="old-open", status="running"))
        insert_jobs(conn, [
            make_job("old", finished_at=old),
            make_job("old-running", status="running", finished_at=None, created_at=old),
            make_job("recent", finished_at=now - timedelta(days=1)),
            make_job("old-of-done-bulk", finished_at=old, bulk_id="old-done"),
            make_job("old-of-open-bulk", finished_at=old, bulk_id="old-open"),
        ])  # fmt: skip
    (tmp_path / "bulk" / "old-done").mkdir(parents=True)


KEPT = ["old-of-open-bulk", "old-running", "recent"]


def test_purge_counts_first_then_deletes_old_finished_rows_and_files(db, tmp_path):
    now = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    add_history(db, now, tmp_path)
    with db.connect() as conn:
        dry = retention.purge(conn, now - timedelta(days=30), tmp_path, dry_run=True)
    assert (dry.jobs, dry.bulk_jobs, dry.dry_run) == (2, 1, True)
    assert len(remaining(db)) == 5 and (tmp_path / "bulk" / "old-done").exists()
    with db.connect() as conn:
        done = retention.purge(conn, now - timedelta(days=30), tmp_path)
    assert (done.jobs, done.bulk_jobs, done.dry_run) == (2, 1, False)
    assert remaining(db) == KEPT
    assert not (tmp_path / "bulk" / "old-done").exists()


def test_the_command_purges_by_age_with_a_dry_run_and_a_count(db, scratch_database, tmp_path):
    add_history(db, datetime.now(UTC), tmp_path)
    env = {**os.environ, "INFERQ_DATABASE_URL": scratch_database, "INFERQ_STATE_DIR": str(tmp_path)}
    env.pop("INFERQ_RETENTION_DAYS", None)
    refused = run_cli("history", "purge", env=env, check=False)
    assert refused.returncode == 2 and "--older-than" in refused.stderr
    assert run_cli("history", "purge", "--older-than", "soon", env=env, check=False).returncode == 2
    dry = run_cli("history", "purge", "--older-than", "30d", "--dry-run", env=env)
    assert dry.stdout.startswith("would delete 2 jobs and 1 bulk jobs finished before ")
    assert len(remaining(db)) == 5
    done = json.loads(run_cli("history", "purge", "--older-than", "30d", "--json", env=env).stdout)
    assert (done["jobs"], done["bulk_jobs"], done["dry_run"]) == (2, 1, False)
    assert remaining(db) == KEPT
    again = run_cli("history", "purge", env={**env, "INFERQ_RETENTION_DAYS": "30"})  # the setting as default
    assert again.stdout.startswith("deleted 0 jobs and 0 bulk jobs")


def test_the_bulk_workers_maintenance_purges_only_when_retention_is_set(
    db, scratch_database, settings, tmp_path
):
    add_history(db, datetime.now(UTC), tmp_path)
    base = dataclasses.replace(
        settings, database_url=scratch_database, state_dir=tmp_path, topic_prefix="tret"
    )
    maintain(db, base, datetime.now(UTC))  # what the beat's task runs every minute
    assert len(remaining(db)) == 5
    maintain(db, dataclasses.replace(base, retention_days=30.0), datetime.now(UTC))
    assert remaining(db) == KEPT
