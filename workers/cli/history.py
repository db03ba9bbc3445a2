"""`inferq history`: job history per tenant/class/bucket, per worker and per bulk job."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from datetime import datetime
from typing import Any

from workers.cli import tables
from workers.clock import utcnow

REPORTS = ("jobs", "workers", "bulk")

# What the terminal table shows (all columns go to --json and --csv): (column, header).
TABLE_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "jobs": (
        ("bucket_start", "bucket (UTC)"),
        ("tenant", "tenant"),
        ("priority", "class"),
        ("model", "model"),
        ("jobs", "jobs"),
        ("succeeded", "ok"),
        ("failed", "failed"),
        ("expired", "expired"),
        ("cancelled", "cancel"),
        ("rejected", "reject"),
        ("prompt_tokens", "prompt tok"),
        ("completion_tokens", "compl tok"),
        ("ttft_p50_ms", "ttft p50"),
        ("ttft_p95_ms", "p95"),
        ("ttft_p99_ms", "p99"),
        ("itl_p50_ms", "itl p50"),
        ("itl_p95_ms", "p95"),
        ("itl_p99_ms", "p99"),
        ("e2e_p50_ms", "e2e p50"),
        ("e2e_p95_ms", "p95"),
        ("e2e_p99_ms", "p99"),
    ),
    "workers": (
        ("bucket_start", "bucket (UTC)"),
        ("worker_id", "worker"),
        ("jobs", "jobs"),
        ("succeeded", "ok"),
        ("prompt_tokens", "prompt tok"),
        ("completion_tokens", "compl tok"),
        ("busy_s", "busy s"),
        ("tokens_per_busy_s", "tok/busy s"),
    ),
    "bulk": (
        ("bulk_id", "bulk"),
        ("tenant", "tenant"),
        ("status", "status"),
        ("expected_jobs", "jobs"),
        ("done", "done"),
        ("succeeded", "ok"),
        ("failed", "failed"),
        ("cancelled", "cancel"),
        ("expired", "expired"),
        ("invalid_lines", "invalid"),
        ("total_tokens", "tokens"),
        ("completion_tokens_per_s", "compl tok/s"),
        ("created_at", "created (UTC)"),
    ),
}


DESCRIPTION = (
    "Summaries of the jobs table (latency percentiles, counts, tokens). "
    "Buckets are in UTC; the same answers come from the SQL functions job_stats/worker_stats "
    "and the view bulk_progress (see docs/bulk-and-history.md)."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "history",
        help="job history: per tenant/class/model/bucket, per worker, per bulk job",
        description=DESCRIPTION,
    )
    p.add_argument("--since", default="24h", help="start: 24h, 7d, 90m (ago) or an ISO time (default: 24h)")
    p.add_argument("--until", default=None, help="end: same forms as --since (default: now)")
    p.add_argument("--tenant", default=None, help="only this tenant (jobs and bulk reports)")
    p.add_argument(
        "--model", default=None, help="only this model, the base's name or an adapter's (jobs report)"
    )
    p.add_argument("--by", choices=("hour", "day"), default="hour", help="bucket size (default: hour)")
    p.add_argument("--report", choices=(*REPORTS, "all"), default="all",
                   help="which summary (default: all; --csv needs one)")  # fmt: skip
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print JSON (all columns)")
    fmt.add_argument("--csv", action="store_true", help="print CSV (all columns) of one --report")
    p.set_defaults(func=_history)
    verbs = p.add_subparsers(dest="history_command", metavar="VERB")
    purge = verbs.add_parser(
        "purge",
        help="delete finished jobs and bulk jobs older than an age",
        description="Delete terminal jobs and finished bulk jobs (with their files) that finished longer "
        "ago than --older-than; jobs of a bulk job still open are kept. Prints what it deleted (with "
        "--dry-run, what it would delete). The bulk worker runs the same purge every minute when "
        "INFERQ_RETENTION_DAYS is set, and never otherwise.",
    )
    purge.add_argument(
        "--older-than",
        default=None,
        metavar="AGE",
        help="30d, 12h, 2w, 90m (default: INFERQ_RETENTION_DAYS days; one of the two is needed)",
    )
    purge.add_argument("--dry-run", action="store_true", help="count what would be deleted, delete nothing")
    purge.add_argument("--json", action="store_true", help="print the counts as JSON")
    purge.set_defaults(func=_purge)


def _purge(args: argparse.Namespace) -> int:
    from datetime import timedelta

    from workers.db import history, retention
    from workers.db.connect import make_engine
    from workers.settings import Settings

    settings = Settings.from_env()
    try:
        if args.older_than is not None:
            age = history.parse_age(args.older_than)
        elif settings.retention_days is not None:
            age = timedelta(days=settings.retention_days)
        else:
            raise ValueError("give --older-than (e.g. 30d) or set INFERQ_RETENTION_DAYS")
    except ValueError as exc:
        print(f"inferq history purge: {exc}", file=sys.stderr)
        return 2
    cutoff = utcnow() - age
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            done = retention.purge(conn, cutoff, settings.state_dir, dry_run=args.dry_run)
    finally:
        engine.dispose()
    if args.json:
        doc = {"jobs": done.jobs, "bulk_jobs": done.bulk_jobs, "dry_run": done.dry_run}
        print(json.dumps({**doc, "finished_before": cutoff.isoformat()}))
    else:
        verb = "would delete" if done.dry_run else "deleted"
        print(
            f"{verb} {done.jobs} jobs and {done.bulk_jobs} bulk jobs finished before "
            f"{cutoff:%Y-%m-%d %H:%M} UTC"
        )
    return 0


def _history(args: argparse.Namespace) -> int:
    from workers.db import history
    from workers.db.connect import make_engine
    from workers.settings import Settings

    now = utcnow()
    try:
        since = history.parse_time(args.since, now)
        until = history.parse_time(args.until, now) if args.until else now
    except ValueError as exc:
        print(f"inferq history: {exc}", file=sys.stderr)
        return 2
    if args.csv and args.report == "all":
        print("inferq history: --csv prints one table; choose --report jobs|workers|bulk", file=sys.stderr)
        return 2
    names = REPORTS if args.report == "all" else (args.report,)
    window = history.Window(since, until, args.by)
    # history over a long window may take its time: no statement timeout
    engine = make_engine(Settings.from_env().database_url, statement_timeout_ms=0)
    try:
        with engine.connect() as conn:
            queries = {
                "jobs": lambda: history.job_stats(conn, window, args.tenant, args.model),
                "workers": lambda: history.worker_stats(conn, window),
                "bulk": lambda: history.bulk_progress(conn, since=since, tenant=args.tenant),
            }
            reports = [queries[name]() for name in names]
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps({r.name: r.records() for r in reports}, default=_json_value, indent=2))
    elif args.csv:
        write_csv(reports[0], sys.stdout)
    else:
        for report in reports:
            print(f"== {report.name} ({window.since:%Y-%m-%d %H:%M} .. {window.until:%Y-%m-%d %H:%M} UTC)")
            print(format_table(report, TABLE_COLUMNS[report.name]) + "\n")
    return 0


def _json_value(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else str(value)


def format_table(report, columns: tuple[tuple[str, str], ...]) -> str:
    """A plain aligned text table of the chosen columns; numbers right-aligned."""
    index = {name: i for i, name in enumerate(report.columns)}
    rows = [[row[index[name]] for name, _ in columns] for row in report.rows]
    return tables.render([header for _, header in columns], rows, missing="-")


def write_csv(report, stream) -> None:
    writer = csv.writer(stream)
    writer.writerow(report.columns)
    for row in report.rows:
        writer.writerow(["" if v is None else v.isoformat() if isinstance(v, datetime) else v for v in row])
