"""The demo's history queries run on PostgreSQL and answer from the jobs rows (a scratch database)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tests.workers.history_factories import insert_jobs, make_job, migrated_engine
from workers.demo.queries import HISTORY_QUERIES, run_history_queries

pytestmark = pytest.mark.services


def test_history_queries_answer_from_recent_rows(scratch_database):
    url = scratch_database
    recent = datetime.now(UTC) - timedelta(minutes=5)
    rows = [
        make_job("h1", priority="high", created_at=recent, ttft_ms=40.0, e2e_ms=400.0),
        make_job(
            "l1", tenant="globex", priority="low", created_at=recent, ttft_ms=300.0, completion_tokens=30
        ),
        make_job("old", created_at=recent - timedelta(days=3)),
    ]
    engine = migrated_engine(url)
    with engine.begin() as conn:
        insert_jobs(conn, rows)
    engine.dispose()
    (_, _, by_tenant), (_, _, by_class), (_, _, buckets) = run_history_queries(url)
    assert len(HISTORY_QUERIES) == 3
    assert [(r["tenant"], r["jobs"], r["tokens_out"]) for r in by_tenant] == [
        ("globex", 1, 30),
        ("acme", 1, 20),
    ]
    assert [(r["priority"], r["ttft_p50_ms"], r["e2e_p95_ms"]) for r in by_class] == [
        ("high", 40, 400),
        ("low", 300, 1000),
    ]
    assert sorted((r["tenant"], r["priority"], r["jobs"]) for r in buckets) == [
        ("acme", "high", 1),
        ("globex", "low", 1),
    ]
