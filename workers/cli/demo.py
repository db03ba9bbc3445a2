"""`inferq demo`: a worker, a handful of chat questions, answers streamed live, their rows, history in SQL."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from gpu.model_source import DEFAULT_MODEL, MODEL_HELP

# (priority, tenant, question): short chat questions a 135M instruction model answers well
DEMO_JOBS = (
    ("high", "acme", "What is the capital of France?"),
    ("normal", "acme", "Explain continuous batching in one sentence."),
    ("normal", "globex", "Give me two tips for writing clear emails."),
    ("low", "globex", "Write a haiku about message queues."),
    ("low", "initech", "What is a good name for a pet goldfish?"),
)


DESCRIPTION = (
    "Start a worker, post a handful of chat questions across priorities and tenants, show "
    "their answers as they stream from Kafka, then their rows in PostgreSQL and a few SQL queries "
    "over job history. Checks that every streamed text equals its stored row. Needs `inferq up`."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run the end-to-end demo", description=DESCRIPTION)
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"{MODEL_HELP} (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=run)


def _start_worker(args: argparse.Namespace, log_path) -> subprocess.Popen:
    from workers.services.paths import open_private

    cmd = [sys.executable, "-m", "workers.cli", "worker", "--worker-id", "demo-worker"]
    cmd += ["--drain-timeout", "5", "--model", args.model]
    log = os.fdopen(open_private(log_path, os.O_WRONLY | os.O_APPEND), "ab")  # handed to the child process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_until_serving(settings, worker: subprocess.Popen, timeout_s: float) -> None:
    """Post only once the worker has joined its group, so the timings shown are the engine's, not start-up."""
    from workers.kafka_io.admin import wait_for_members
    from workers.naming import worker_group

    def alive() -> None:
        if worker.poll() is not None:
            raise SystemExit(f"inferq demo: the worker exited with code {worker.returncode}; see its log")

    group = worker_group(settings.topic_prefix)
    try:
        wait_for_members(settings.kafka_connection, group, 1, timeout_s, alive, at_least=True)
    except TimeoutError:
        raise SystemExit(
            "inferq demo: the worker did not join its consumer group in time; see its log"
        ) from None


def run(args: argparse.Namespace) -> int:
    import uuid

    from workers.cli.jobs import print_rows
    from workers.client import JobClient
    from workers.demo.board import DemoBoard, DemoJob
    from workers.demo.queries import run_history_queries
    from workers.demo.view import follow_tokens, wait_for_rows
    from workers.services.paths import private_dir
    from workers.settings import Settings

    settings = Settings.from_env()
    log_path = settings.state_dir / "logs" / "demo-worker.log"
    private_dir(log_path.parent)
    print(f"starting a worker with model {args.model} (log: {log_path}; a first start converts the model)")
    worker = _start_worker(args, log_path)
    try:
        _wait_until_serving(settings, worker, args.timeout)
        run_id = uuid.uuid4().hex[:8]
        jobs: list[DemoJob] = []
        with JobClient(settings) as client:
            since_ms = int(time.time() * 1000) - 1000
            for i, (priority, tenant, question) in enumerate(DEMO_JOBS):
                job_id = f"demo-{run_id}-{i}"
                messages = [{"role": "user", "content": question}]
                jobs.append(DemoJob(job_id, priority, tenant, question, time.monotonic()))
                job = {
                    "job_id": job_id,
                    "tenant": tenant,
                    "messages": messages,
                    "max_tokens": args.max_tokens,
                }
                client.submit(job, priority)
            client.flush()
        print(f"posted {len(jobs)} jobs; answers stream from Kafka as they are generated:\n")
        streamed = follow_tokens(settings, DemoBoard(jobs), since_ms, args.timeout, worker)
        print("\nrows in PostgreSQL:\n")
        rows = wait_for_rows(settings, [j.job_id for j in jobs], args.timeout)
        print_rows(rows, width=32)
        for title, sql, result in run_history_queries(settings.database_url):
            print(f"\n-- {title}\n{sql};\n")
            print_rows(result, width=32)
        return _verdict(rows, streamed)
    finally:
        _stop(worker)


def _verdict(rows: list[dict], streamed: dict[str, str]) -> int:
    """Say whether every job succeeded and every streamed text equals its stored row."""
    failed = [r["job_id"] for r in rows if r["status"] != "succeeded"]
    differ = [r["job_id"] for r in rows if streamed.get(r["job_id"]) != r["output_text"]]
    missing = sorted(set(streamed) - {r["job_id"] for r in rows})
    if not (failed or differ or missing):
        print(f"\nall {len(rows)} jobs succeeded, and every streamed text equals its stored row")
        return 0
    for label, ids in (("did not succeed", failed), ("streamed text differs from the row", differ)):
        if ids:
            print(f"\n{label}: {', '.join(ids)}")
    if missing:
        print(f"\nno row for: {', '.join(missing)}")
    print("see the worker log")
    return 1


def _stop(worker: subprocess.Popen) -> None:
    if worker.poll() is not None:
        return
    os.killpg(worker.pid, signal.SIGTERM)  # the worker finishes in-flight jobs, commits, exits 0
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
