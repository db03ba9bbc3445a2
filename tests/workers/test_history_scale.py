"""The hourly-latency query over 1,000,000 synthetic rows uses the (tenant, created_at) index.

Run with `-s` to see the EXPLAIN ANALYZE; timing is not asserted (that is a benchmark's job), the plan is.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import text

from tests.workers.history_factories import T0, insert_synthetic_history, migrated_engine

pytestmark = [pytest.mark.services, pytest.mark.slow]

ROWS = 1_000_000
HOURLY_LATENCY = """
SELECT bucket_start, priority, jobs, ttft_p50_ms, ttft_p95_ms, ttft_p99_ms, itl_p50_ms, itl_p99_ms,
       e2e_p50_ms, e2e_p99_ms
FROM job_stats('hour', :since, :until)
WHERE tenant = :tenant
ORDER BY bucket_start, priority
"""


def _plan_nodes(node: dict):
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def test_hourly_latency_for_one_tenant_over_a_day_uses_the_index(scratch_database):
    engine = migrated_engine(scratch_database)
    with engine.begin() as conn:
        insert_synthetic_history(conn, ROWS, days=30, tenants=20)
    params = {"since": T0 - timedelta(days=1), "until": T0, "tenant": "tenant-7"}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM jobs")).scalar_one() == ROWS
        rows = conn.execute(text(HOURLY_LATENCY), params).all()
        plan = conn.execute(text("EXPLAIN (ANALYZE, FORMAT JSON) " + HOURLY_LATENCY), params).scalar_one()
        shown = conn.execute(text("EXPLAIN ANALYZE " + HOURLY_LATENCY), params).scalars().all()
    engine.dispose()
    print("\n".join(shown))
    assert len(rows) == 24 * 3  # every hour, every class
    nodes = list(_plan_nodes(plan[0]["Plan"]))
    assert any(n.get("Index Name") == "ix_jobs_tenant_created_at" for n in nodes), json.dumps(plan, indent=1)
    assert not any(n["Node Type"] == "Seq Scan" for n in nodes)
    # the index reads only the tenant's day: about 1M / 20 tenants / 30 days rows, not the tenant's month
    scanned = max(n["Actual Rows"] for n in nodes if n.get("Index Name") == "ix_jobs_tenant_created_at")
    assert scanned < 3 * ROWS / 20 / 30
