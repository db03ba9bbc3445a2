"""`python -m bench.bulk`: bulk throughput, and high-priority TTFT idle vs. during a bulk job.

A private deployment (own topic prefix, one `inferq worker`, one `inferq bulk-worker`):
1. probes: high-priority jobs one at a time on the idle worker (TTFT from their jobs rows);
2. a bulk job of --lines lines (class low) is submitted; once it is running, the same probes again;
3. the bulk job's completion tokens per second, from first start to last finish (bulk_progress).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import create_engine, text

from bench.e2e.deploy import WorkerProcess, make_private_settings
from workers.client import JobClient
from workers.settings import Settings

WORDS = ("the", "a", "river", "stone", "cloud", "quiet", "market", "engine", "seven", "orange", "lamp")


def write_batch(path: Path, lines: int, max_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(lines):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
            # no `model`: the worker's base, whatever its --model (a name given must be one it serves)
            body = {"prompt": prompt, "max_tokens": max_tokens}
            f.write(
                json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": body})
            )
            f.write("\n")


def wait_row(db, job_id: str, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with db.connect() as conn:
            row = conn.execute(text("SELECT * FROM jobs WHERE job_id = :j"), {"j": job_id}).mappings().first()
        if row is not None and row["status"] not in ("queued", "running"):
            return dict(row)
        time.sleep(0.05)
    raise TimeoutError(f"{job_id} did not finish in {timeout_s}s")


def probe(client: JobClient, db, tag: str, count: int) -> list[float]:
    """TTFTs (ms) of `count` high-priority jobs sent one after the other."""
    ttfts = []
    for i in range(count):
        job_id = client.submit({"job_id": f"probe-{tag}-{i}-{time.time_ns()}", "prompt": "hello " * 16,
                                "max_tokens": 8}, priority="high").job_id  # fmt: skip
        client.flush()
        ttfts.append(wait_row(db, job_id)["ttft_ms"])
    return ttfts


def progress(db, bulk_id: str) -> dict:
    with db.connect() as conn:
        return dict(conn.execute(text("SELECT * FROM bulk_progress WHERE bulk_id = :b"), {"b": bulk_id})
                    .mappings().one())  # fmt: skip


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"n": len(values), "p50_ms": statistics.median(ordered), "max_ms": ordered[-1],
            "mean_ms": statistics.fmean(ordered)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bulk", description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=10_000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--probes", type=int, default=10)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the worker")
    p.add_argument("--worker-arg", action="append", default=[], help="extra `inferq worker` argument")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="result file (default: bench/results/bulk-*.json)")
    args = p.parse_args(argv)

    settings = make_private_settings(Settings.from_env())
    tmp = Path(tempfile.mkdtemp(prefix="inferq-bench-bulk-"))
    env = {**os.environ, "INFERQ_TOPIC_PREFIX": settings.topic_prefix, "INFERQ_STATE_DIR": str(tmp / "state"),
           "INFERQ_DATABASE_URL": settings.database_url, "INFERQ_KAFKA": settings.kafka}  # fmt: skip
    worker = WorkerProcess(settings, tmp / "worker.log", args.threads, args.worker_arg)
    cmd = [sys.executable, "-m", "workers.cli", "bulk-worker", "--loglevel", "WARNING"]
    log = (tmp / "bulk.log").open("wb")
    bulk_worker = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    db = create_engine(settings.database_url)
    client = JobClient(settings)
    try:
        probe(client, db, "warmup", 2)
        idle = probe(client, db, "idle", args.probes)
        write_batch(tmp / "in.jsonl", args.lines, args.max_tokens, args.seed)
        done = subprocess.run([sys.executable, "-m", "workers.cli", "bulk", "submit", str(tmp / "in.jsonl")],
                              env=env, capture_output=True, text=True, check=True)  # fmt: skip
        bulk_id = done.stdout.strip()
        while progress(db, bulk_id)["running"] == 0:
            time.sleep(0.2)
        loaded = probe(client, db, "loaded", args.probes)
        during = progress(db, bulk_id)
        while (p_now := progress(db, bulk_id))["status"] not in ("completed", "cancelled", "failed"):
            print(f"\rbulk {p_now['done']}/{p_now['expected_jobs']}", end="", file=sys.stderr, flush=True)
            time.sleep(2)
        final = progress(db, bulk_id)
    finally:
        client.close()
        os.killpg(bulk_worker.pid, signal.SIGTERM)  # its group: the embedded beat is a child process
        bulk_worker.wait(60)
        worker.stop()
    seconds = (final["last_finished_at"] - final["first_started_at"]).total_seconds()
    result = {
        "lines": args.lines, "max_tokens": args.max_tokens, "worker_threads": args.threads,
        "worker_args": args.worker_arg, "bulk_id": bulk_id, "bulk_seconds": seconds,
        "bulk_completion_tokens": final["completion_tokens"], "bulk_prompt_tokens": final["prompt_tokens"],
        "bulk_completion_tokens_per_s": final["completion_tokens"] / seconds,
        "bulk_total_tokens_per_s": final["total_tokens"] / seconds,
        "bulk_done_when_loaded_probes_ended": during["done"],
        "ttft_idle": summary(idle), "ttft_during_bulk": summary(loaded),
    }  # fmt: skip
    out = args.json or Path("bench/results") / f"bulk-{datetime.now(UTC):%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("\n" + json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
