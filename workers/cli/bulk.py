"""`inferq bulk submit|status|wait|fetch|cancel` and `inferq bulk-worker` (the Celery worker of bulk jobs)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from schemas.topics import PRIORITY_CLASSES
from workers.cli.options import add_log_options, add_timeout_option


def register(subparsers: argparse._SubParsersAction) -> None:
    bulk = subparsers.add_parser(
        "bulk",
        help="offline bulk generation from an OpenAI Batch JSONL file",
        description="Submit an OpenAI Batch file (one request per line); a Celery bulk worker "
        "(`inferq bulk-worker`) turns its lines into jobs and writes Batch output and errors files.",
    )
    verbs = bulk.add_subparsers(dest="bulk_command", metavar="VERB", required=True)
    p = verbs.add_parser("submit", help="validate a Batch file and start it; prints the bulk id")
    p.add_argument("file", type=Path, help="JSONL, one {custom_id, method, url, body} per line")
    p.add_argument("--tenant", default="default")
    p.add_argument("--priority", choices=PRIORITY_CLASSES, default="low", help="job class (default: low)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="run the valid lines; report invalid ones in the errors file")  # fmt: skip
    p.set_defaults(func=_submit)
    p = verbs.add_parser("status", help="counts by status, tokens, throughput, ETA")
    p.add_argument("bulk_id")
    p.add_argument("--json", action="store_true", help="the bulk_progress row as JSON")
    p.set_defaults(func=_status)
    p = verbs.add_parser("wait", help="show a progress bar until the bulk job has finished")
    p.add_argument("bulk_id")
    add_timeout_option(p, None, "the bulk job (exit 124)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between updates")
    p.set_defaults(func=_wait)
    p = verbs.add_parser("fetch", help="the output file (Batch output format), in input order")
    p.add_argument("bulk_id")
    p.add_argument("-o", "--output", type=Path, default=None, help="write here (default: stdout)")
    p.add_argument("--errors", type=Path, default=None, help="also write the errors file here")
    p.set_defaults(func=_fetch)
    p = verbs.add_parser("cancel", help="stop submitting and cancel the jobs not finished yet")
    p.add_argument("bulk_id")
    p.set_defaults(func=_cancel)

    p = subparsers.add_parser(
        "bulk-worker",
        help="run the Celery worker (with its beat) that produces and finalises bulk jobs",
        description="Runs in this process until interrupted. Broker: INFERQ_CELERY_BROKER, or the "
        "project's PostgreSQL when unset. Needs `inferq worker`s for the jobs themselves.",
    )
    p.add_argument("--concurrency", type=int, default=4, help="task threads (default: 4)")
    p.add_argument("--no-beat", action="store_true", help="do not embed the beat (run one elsewhere)")
    add_log_options(p)
    p.set_defaults(func=_bulk_worker)


def _err(message: str) -> int:
    print(f"inferq bulk: {message}", file=sys.stderr)
    return 1


def _engine():
    from workers.db.connect import make_engine
    from workers.settings import Settings

    settings = Settings.from_env()
    return settings, make_engine(settings.database_url)


def _submit(args: argparse.Namespace) -> int:
    from workers.bulk.batch_format import summarize
    from workers.bulk.celery_app import PRODUCE, make_app
    from workers.db import bulk_jobs as store
    from workers.services.paths import private_dir

    if not args.file.is_file():
        return _err(f"no such file: {args.file}")
    summary = summarize(args.file)
    for error in summary.errors:
        print(error.message, file=sys.stderr)
    if summary.invalid and not args.skip_invalid:
        return _err(f"{summary.invalid} of {summary.total} lines are invalid; nothing submitted "
                    "(fix them, or use --skip-invalid to report them in the errors file)")  # fmt: skip
    if summary.total == summary.invalid:
        return _err("no valid lines")
    settings, engine = _engine()
    bulk_id = store.new_bulk_id()
    folder = settings.state_dir / "bulk" / bulk_id
    private_dir(folder)  # its prompts, and the outputs written beside them
    shutil.copyfile(args.file, folder / "input.jsonl")  # the worker reads its own copy
    with engine.begin() as conn:
        store.create(
            conn, bulk_id, tenant=args.tenant, priority=args.priority, endpoint=summary.endpoint,
            input_path=str(folder / "input.jsonl"), total_lines=summary.total, invalid_lines=summary.invalid,
            metadata={"source": str(args.file.resolve()), "skip_invalid": args.skip_invalid,
                      "topic_prefix": settings.topic_prefix},
        )  # fmt: skip
    try:
        make_app(settings).send_task(PRODUCE, args=[bulk_id])
    except Exception as exc:  # recorded already: a bulk worker's periodic tick starts it anyway
        print(f"inferq bulk: could not reach the Celery broker ({exc}); a running `inferq bulk-worker` "
              "will start the bulk job within seconds", file=sys.stderr)  # fmt: skip
    print(f"{summary.total - summary.invalid} jobs ({summary.invalid} invalid lines skipped), class "
          f"{args.priority}; follow with `inferq bulk wait {bulk_id}`", file=sys.stderr)  # fmt: skip
    print(bulk_id)
    return 0


def _status(args: argparse.Namespace) -> int:
    from workers.bulk.status_text import status_text
    from workers.db import bulk_jobs as store

    _, engine = _engine()
    with engine.connect() as conn:
        p, row = store.progress(conn, args.bulk_id), store.get(conn, args.bulk_id)
    if p is None:
        return _err(f"no bulk job {args.bulk_id}")
    final = (row["metadata"] or {}).get("final")
    if args.json:
        print(json.dumps({**p, "final": final, "output_path": row["output_path"]}, default=str, indent=2))
    else:
        print(status_text(p, final=final) + (f"\nerror       {row['error']}" if row["error"] else ""))
    return 0


def _wait(args: argparse.Namespace) -> int:
    from schemas.statuses import BULK_FINISHED_STATUSES
    from workers.bulk.status_text import progress_line
    from workers.db import bulk_jobs as store

    _, engine = _engine()
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    tty = sys.stderr.isatty()
    last = None
    while True:
        with engine.connect() as conn:
            p = store.progress(conn, args.bulk_id)
            row = store.get(conn, args.bulk_id)
        if p is None:
            return _err(f"no bulk job {args.bulk_id}")
        finished = p["status"] in BULK_FINISHED_STATUSES and (row["output_path"] or p["status"] == "failed")
        if tty:  # one line, redrawn
            print(
                "\r" + progress_line(p) + "\x1b[K", end="\n" if finished else "", file=sys.stderr, flush=True
            )
        elif (p["done"], p["status"]) != last or finished:  # a log: a line per change
            print(progress_line(p), file=sys.stderr, flush=True)
            last = (p["done"], p["status"])
        if finished:  # the files are written (a cancelled bulk job gets them too)
            final = (row["metadata"] or {}).get("final")
            ok = final["succeeded"] if final else p["succeeded"]
            bad = final["failed"] + final["invalid"] + final["unfinished"] if final else p["done"] - ok
            print(f"{p['status']}: {ok} lines in the output file, {bad} in the errors file; "
                  f"`inferq bulk fetch {args.bulk_id} -o out.jsonl`", file=sys.stderr)  # fmt: skip
            return 0 if p["status"] == "completed" else 1
        if deadline is not None and time.monotonic() > deadline:
            print(file=sys.stderr)
            _err(f"still {p['status']} after {args.timeout:.0f}s")
            return 124
        time.sleep(args.interval)


def _fetch(args: argparse.Namespace) -> int:
    from workers.db import bulk_jobs as store

    _, engine = _engine()
    with engine.connect() as conn:
        row = store.get(conn, args.bulk_id)
    if row is None:
        return _err(f"no bulk job {args.bulk_id}")
    if not row["output_path"]:
        return _err(f"bulk job {args.bulk_id} is {row['status']}; its files are written when it ends")
    if args.errors:
        shutil.copyfile(row["error_path"], args.errors)
    if args.output is None:
        with open(row["output_path"], "rb") as f:
            shutil.copyfileobj(f, sys.stdout.buffer)
    else:
        shutil.copyfile(row["output_path"], args.output)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from workers.bulk.cancel import cancel
    from workers.kafka_io import Producer

    settings, engine = _engine()
    producer = Producer(settings.kafka_connection, "inferq-bulk-cancel")

    def send(job_id: str, tenant: str) -> None:
        message = {"type": "cancel", "job_id": job_id, "tenant": tenant}
        producer.send(settings.topics.control_for(tenant), job_id, json.dumps(message).encode())

    try:
        sent = cancel(engine, args.bulk_id, send)
        producer.flush()
    finally:
        producer.close()
    if sent is None:
        return _err(f"bulk job {args.bulk_id} does not exist or has already finished")
    print(f"cancelled {args.bulk_id}: {sent} unfinished jobs cancelled; its files follow shortly",
          file=sys.stderr)  # fmt: skip
    return 0


def _bulk_worker(args: argparse.Namespace) -> int:
    import socket

    from celery import signals

    from workers import logs
    from workers.bulk.celery_app import make_app, queue
    from workers.bulk.tasks import register
    from workers.services.paths import private_dir
    from workers.settings import Settings

    settings = Settings.from_env()
    private_dir(settings.state_dir)
    hostname = f"bulk-{os.getpid()}@{socket.gethostname()}"

    def setup_logging(**_kwargs: object) -> None:  # a receiver here means Celery leaves logging to us
        logs.configure(args.log_level, args.log_format, hostname)

    setup_logging()  # now too: warnings Celery raises while starting become log lines
    signals.setup_logging.connect(setup_logging, weak=False)
    # --quiet: no start-up banner on stdout (it is not a log line, and would break JSON logs)
    quiet = ["--quiet"] if args.log_format == "json" else []
    argv = [*quiet, "worker", "--pool", "threads", "--concurrency", str(args.concurrency),
            "--queues", queue(settings), "--loglevel", args.log_level,
            "--hostname", hostname, "--without-mingle", "--without-gossip"]  # fmt: skip
    if not args.no_beat:
        argv += ["--beat", "--schedule", str(settings.state_dir / f"celerybeat-{settings.topic_prefix}")]
    app = make_app(settings)
    register(app, settings)
    app.worker_main(argv)
    return 0
