"""History views and `inferq history` on known data (real PostgreSQL, a scratch database)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import text

from tests.workers.history_factories import T0, insert_jobs, make_job, migrated_engine, percentile
from workers.cli import main
from workers.db import history

pytestmark = pytest.mark.services

TTFT = [12.0, 20.0, 31.0, 45.0, 50.0, 58.0, 77.0, 90.0, 130.0, 400.0]


@pytest.fixture
def db(scratch_database):
    engine = migrated_engine(scratch_database)
    rows = [make_job(f"a{i}", ttft_ms=t, mean_itl_ms=t / 10, e2e_ms=t * 10) for i, t in enumerate(TTFT)]
    rows[8] |= {"status": "failed", "completion_tokens": 0}
    rows[9] |= {"status": "expired"}
    rows += [
        make_job("a-late", created_at=T0 + timedelta(hours=1, minutes=5), ttft_ms=999.0),
        make_job("a-high", priority="high", ttft_ms=5.0),
        make_job("b1", tenant="bravo", status="cancelled", ttft_ms=None, mean_itl_ms=None, e2e_ms=None),
        make_job("b2", tenant="bravo", status="running", finished_at=None, worker_id="w2"),
    ]
    with engine.begin() as conn:
        insert_jobs(conn, rows)
    yield engine
    engine.dispose()


def by_key(report: history.Report) -> dict[tuple, dict]:
    return {(r["bucket_start"], r["tenant"], r["priority"]): r for r in report.records()}


def test_job_stats_give_known_counts_tokens_and_percentiles(db):
    window = history.Window(T0 - timedelta(hours=1), T0 + timedelta(hours=2), "hour")
    with db.connect() as conn:
        rows = by_key(history.job_stats(conn, window, tenant="acme"))
    assert set(rows) == {
        (T0, "acme", "normal"),
        (T0, "acme", "high"),
        (T0 + timedelta(hours=1), "acme", "normal"),
    }
    r = rows[(T0, "acme", "normal")]
    assert (r["jobs"], r["succeeded"], r["failed"], r["expired"], r["in_flight"]) == (10, 8, 1, 1, 0)
    assert (r["prompt_tokens"], r["completion_tokens"]) == (100, 180)
    for q, column in ((0.5, "ttft_p50_ms"), (0.95, "ttft_p95_ms"), (0.99, "ttft_p99_ms")):
        assert r[column] == pytest.approx(percentile(TTFT, q))
    assert r["ttft_p50_ms"] == pytest.approx(54.0)  # between 50 and 58
    assert r["itl_p95_ms"] == pytest.approx(percentile([t / 10 for t in TTFT], 0.95))
    assert r["e2e_p99_ms"] == pytest.approx(percentile([t * 10 for t in TTFT], 0.99))
    assert rows[(T0 + timedelta(hours=1), "acme", "normal")]["ttft_p99_ms"] == 999.0


def test_day_buckets_and_the_views_agree_with_the_function(db):
    window = history.Window(T0 - timedelta(days=1), T0 + timedelta(days=1), "day")
    with db.connect() as conn:
        daily = by_key(history.job_stats(conn, window))
        view = conn.execute(text("SELECT * FROM job_stats_daily")).mappings().all()
        hourly_view = conn.execute(text("SELECT count(*) FROM job_stats_hourly")).scalar_one()
    day = T0.replace(hour=0)
    assert daily[(day, "acme", "normal")]["jobs"] == 11  # both hours in one day
    cancelled = daily[(day, "bravo", "normal")]
    assert (cancelled["cancelled"], cancelled["in_flight"], cancelled["ttft_p50_ms"]) == (1, 1, 50.0)
    assert {(v["bucket_start"], v["tenant"], v["priority"]): dict(v) for v in view} == daily
    assert hourly_view == 4


def test_the_window_excludes_jobs_outside_it(db):
    window = history.Window(T0 + timedelta(minutes=30), T0 + timedelta(hours=3), "hour")
    with db.connect() as conn:
        report = history.job_stats(conn, window)
    assert [(r["tenant"], r["jobs"]) for r in report.records()] == [("acme", 1)]


def test_worker_stats_count_overlapping_jobs_once_in_busy_time(scratch_database):
    engine = migrated_engine(scratch_database)
    spans = [(0, 10, 100), (5, 15, 50), (20, 25, 10)]  # seconds from T0, completion tokens
    rows = [make_job(f"w{i}", worker_id="w9", started_at=T0 + timedelta(seconds=s),
                     finished_at=T0 + timedelta(seconds=f), completion_tokens=ct)
            for i, (s, f, ct) in enumerate(spans)]  # fmt: skip
    rows.append(make_job("other", worker_id="w8", started_at=T0, finished_at=T0 + timedelta(seconds=4)))
    with engine.begin() as conn:
        insert_jobs(conn, rows)
    with engine.connect() as conn:
        report = history.worker_stats(conn, history.Window(T0, T0 + timedelta(hours=1), "hour"))
    engine.dispose()
    by_worker = {r["worker_id"]: r for r in report.records()}
    w9 = by_worker["w9"]
    assert (w9["jobs"], w9["completion_tokens"], w9["busy_s"]) == (3, 160, 20.0)  # [0,15] + [20,25]
    assert w9["tokens_per_busy_s"] == pytest.approx(8.0)
    assert by_worker["w8"]["busy_s"] == 4.0


def test_bulk_progress_counts_a_bulk_jobs_rows(scratch_database):
    engine = migrated_engine(scratch_database)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO bulk_jobs (bulk_id, tenant, status, total_lines, invalid_lines) "
                "VALUES ('bk', 'acme', 'running', 5, 1)"
            )
        )  # its jobs are its tenant's; fmt: skip
        insert_jobs(conn, [
            make_job("bk:1", bulk_id="bk"), make_job("bk:2", bulk_id="bk", status="failed"),
            make_job("bk:3", bulk_id="bk", status="queued", finished_at=None, prompt_tokens=None,
                     completion_tokens=None),
        ])  # fmt: skip
    with engine.connect() as conn:
        (p,) = history.bulk_progress(conn, bulk_id="bk").records()
    engine.dispose()
    assert (p["expected_jobs"], p["jobs"], p["done"], p["succeeded"], p["failed"], p["queued"]) == (
        4,
        3,
        2,
        1,
        1,
        1,
    )
    assert (p["prompt_tokens"], p["completion_tokens"], p["total_tokens"]) == (20, 40, 60)
    assert p["completion_tokens_per_s"] == pytest.approx(40 / 0.995)


def test_cli_prints_json_csv_and_a_table(db, scratch_database, monkeypatch, capsys):
    monkeypatch.setenv("INFERQ_DATABASE_URL", scratch_database)
    args = ["history", "--since", "2026-11-30T09:00", "--until", "2026-11-30T12:00", "--tenant", "acme"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted(data) == ["bulk", "jobs", "workers"]
    assert [(r["priority"], r["jobs"]) for r in data["jobs"]] == [("high", 1), ("normal", 10), ("normal", 1)]
    assert main([*args, "--csv", "--report", "jobs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("bucket_start,tenant,priority,model,jobs,") and len(lines) == 4
    assert main([*args, "--by", "day", "--report", "jobs"]) == 0
    table = capsys.readouterr().out
    assert "2026-11-30 00:00  acme" in table and "ttft p50" in table
    assert main([*args, "--csv"]) == 2  # CSV needs one report


def test_job_stats_by_model_and_the_cli_model_filter(db, scratch_database, monkeypatch, capsys):
    with db.begin() as conn:
        insert_jobs(conn, [make_job(f"x{i}", model="acme/extract", ttft_ms=7.0) for i in range(3)])
    window = history.Window(T0, T0 + timedelta(hours=1), "hour")
    with db.connect() as conn:
        rows = history.job_stats(conn, window, tenant="acme").records()
        only = history.job_stats(conn, window, model="acme/extract").records()
    by_model = {(r["priority"], r["model"]): r["jobs"] for r in rows}
    assert by_model == {("normal", None): 10, ("high", None): 1, ("normal", "acme/extract"): 3}
    assert [(r["model"], r["jobs"], r["ttft_p50_ms"]) for r in only] == [("acme/extract", 3, 7.0)]
    monkeypatch.setenv("INFERQ_DATABASE_URL", scratch_database)
    args = ["history", "--since", "2026-11-30T09:00", "--until", "2026-11-30T12:00", "--report", "jobs"]
    assert main([*args, "--model", "acme/extract"]) == 0
    table = capsys.readouterr().out
    assert "acme/extract" in table and table.count("acme  ") == 1  # one row: the adapter's


def test_parse_time_accepts_durations_and_iso_times():
    now = T0
    assert history.parse_time("90m", now) == T0 - timedelta(minutes=90)
    assert history.parse_time("2d", now) == T0 - timedelta(days=2)
    assert history.parse_time("2026-11-30T08:00", now) == T0 - timedelta(hours=2)
    with pytest.raises(ValueError, match="not a time"):
        history.parse_time("yesterday", now)
