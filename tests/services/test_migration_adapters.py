"""Migration 0009 (the adapters registry, jobs.model, job history by model), on the real server in a scratch
database: the history function groups by model after it, and is as 0002 made it after a downgrade."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import create_engine, inspect, text

from workers.db import migrate

pytestmark = pytest.mark.services

JOBS = [("a", "base-m"), ("b", "base-m"), ("c", "acme/extract")]


def _stats(url: str) -> list[dict]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            query = text("SELECT * FROM job_stats_daily ORDER BY jobs DESC")
            return [dict(r._mapping) for r in conn.execute(query)]
    finally:
        engine.dispose()


def test_0009_adds_the_registry_and_history_by_model_and_takes_them_back(scratch_database: str) -> None:
    migrate.upgrade(scratch_database, "0009")
    engine = create_engine(scratch_database)
    now = datetime.now(UTC)
    try:
        with engine.begin() as conn:
            for job_id, model in JOBS:
                conn.execute(
                    text("INSERT INTO jobs (job_id, priority, status, model, created_at) "
                         "VALUES (:j, 'normal', 'succeeded', :m, :t)"),
                    {"j": job_id, "m": model, "t": now},
                )  # fmt: skip
        assert "adapters" in inspect(engine).get_table_names()
    finally:
        engine.dispose()
    by_model = {r["model"]: r["jobs"] for r in _stats(scratch_database)}
    assert by_model == {"base-m": 2, "acme/extract": 1}

    migrate.downgrade(scratch_database, "0007")
    rows = _stats(scratch_database)
    assert [r["jobs"] for r in rows] == [3] and "model" not in rows[0]  # 0002's function, every model as one
    engine = create_engine(scratch_database)
    try:
        assert "adapters" not in inspect(engine).get_table_names()
        assert "model" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
    finally:
        engine.dispose()
