"""`inferq demo`: a worker, a handful of prompts, tokens streamed live, then the rows in PostgreSQL."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

DEMO_JOBS = (
    ("high", "acme", "Write a haiku about message queues."),
    ("normal", "acme", "Explain continuous batching in one sentence."),
    ("normal", "globex", "List three uses of a dead-letter topic."),
    ("low", "globex", "Summarise the history of the transformer architecture."),
    ("low", "initech", "Translate 'good morning' into French."),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the end-to-end demo",
        description="Start a worker with the default model, post a handful of prompts across priorities and "
        "tenants, stream their tokens live from Kafka, then print their rows from PostgreSQL. "
        "Needs `inferq up`.",
    )
    p.add_argument(
        "--model", default=None, help="local Hugging Face checkpoint dir (default: built-in small Llama)"
    )
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=run)


def _start_worker(args: argparse.Namespace, log_path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "workers.cli", "worker", "--worker-id", "demo-worker", "--grace-s", "5"]
    if args.model:
        cmd += ["--model", args.model]
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_until_serving(settings, worker: subprocess.Popen, timeout_s: float) -> None:
    """Post only once the worker has joined its group, so the timings shown are the engine's, not start-up."""
    from workers.kafka_io import group_members
    from workers.loop import group_id

    deadline = time.monotonic() + timeout_s
    while group_members(settings.kafka_connection, group_id(settings.topic_prefix)) < 1:
        if worker.poll() is not None:
            raise SystemExit(f"inferq demo: the worker exited with code {worker.returncode}; see its log")
        if time.monotonic() > deadline:
            raise SystemExit("inferq demo: the worker did not join its consumer group in time; see its log")
        time.sleep(0.5)


def run(args: argparse.Namespace) -> int:
    import uuid

    from workers.client import JobClient
    from workers.commands.jobs import print_rows
    from workers.demo_view import follow_tokens, wait_for_rows
    from workers.settings import Settings

    settings = Settings.from_env()
    log_path = settings.state_dir / "logs" / "demo-worker.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting a worker (log: {log_path})")
    worker = _start_worker(args, log_path)
    try:
        _wait_until_serving(settings, worker, args.timeout)
        run_id = uuid.uuid4().hex[:8]
        labels: dict[str, str] = {}
        with JobClient(settings) as client:
            since_ms = int(time.time() * 1000) - 1000
            for i, (priority, tenant, prompt) in enumerate(DEMO_JOBS):
                job = {
                    "job_id": f"demo-{run_id}-{i}",
                    "tenant": tenant,
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                }
                job_id = client.submit(job, priority)
                labels[job_id] = f"{priority:>6}/{tenant:<7}"
                print(f"posted {job_id} [{priority}] {prompt}")
            client.flush()
        print(
            "\nstreaming tokens from Kafka as they are generated (the default model is randomly "
            "initialised, so its text is noise; pass --model DIR for a real checkpoint):\n"
        )
        outputs = follow_tokens(settings, labels, since_ms, args.timeout, worker)
        print("\nrows in PostgreSQL:\n")
        rows = wait_for_rows(settings, list(labels), args.timeout)
        print_rows(rows, width=32)
        ok = all(r["status"] == "succeeded" for r in rows)
        ok = ok and all(outputs.get(r["job_id"]) == r["output_text"] for r in rows)
        print(
            "\nevery job succeeded and its streamed text equals the stored output"
            if ok
            else "\nsome jobs did not succeed, or streams differ from the rows: see the worker log"
        )
        return 0 if ok else 1
    finally:
        _stop(worker)


def _stop(worker: subprocess.Popen) -> None:
    if worker.poll() is not None:
        return
    os.killpg(worker.pid, signal.SIGTERM)  # the worker finishes in-flight jobs, commits, exits 0
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
