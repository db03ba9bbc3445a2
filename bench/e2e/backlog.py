"""`python -m bench.e2e.backlog`: a backlog far larger than a worker's cap, and its memory while it drains.

Posts `--jobs` jobs at once (every class) to a private deployment served by one worker with a small
`--max-waiting`, then samples the worker's resident memory (its process and its token-event relay) every
second until every job is terminal. A worker that took the backlog in would grow with it; a capped one holds
at most twice `--max-waiting` jobs and its memory stays flat. Prints RSS at points of the drain and the
slope of a line through the samples, and writes JSON.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.e2e.deploy import WorkerProcess, delete_private_topics, make_private_settings, wait_joined
from bench.report import RESULTS_DIR, format_table, progress, write_json
from workers.client import JobClient
from workers.settings import Settings


def rss_mib(pid: int) -> tuple[float, float]:
    """Resident memory of the worker process and of its children (the token-event relay), MiB."""
    import psutil

    proc = psutil.Process(pid)
    children = sum(c.memory_info().rss for c in proc.children(recursive=True))
    return proc.memory_info().rss / 2**20, children / 2**20


def slope_mib_per_1k_jobs(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of RSS against jobs finished, per thousand jobs."""
    n = len(points)
    if n < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return 1000 * cov / var if var else 0.0


def finished_count(settings: Settings, prefix: str) -> int:
    from sqlalchemy import create_engine, text

    engine = create_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            sql = (
                "SELECT count(*) FROM jobs WHERE job_id LIKE :p AND status IN "
                "('succeeded', 'failed', 'rejected', 'cancelled', 'expired')"
            )
            return int(conn.execute(text(sql), {"p": f"{prefix}-%"}).scalar_one())
    finally:
        engine.dispose()


def run(args: argparse.Namespace) -> int:
    settings = make_private_settings(Settings.from_env())
    log = RESULTS_DIR / "backlog-worker.log"
    extra = [
        "--model",
        args.model,
        "--max-waiting",
        str(args.max_waiting),
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    worker = WorkerProcess(settings, log, threads=args.threads, extra=extra)
    prefix = f"bk-{settings.topic_prefix}"
    samples: list[tuple[float, int, float, float]] = []  # (seconds, jobs finished, worker, relay RSS MiB)
    try:
        wait_joined(settings, worker)
        with JobClient(settings) as client:
            jobs = [{"job_id": f"{prefix}-{i}", "prompt": f"job {i}", "max_tokens": args.max_tokens}
                    for i in range(args.jobs)]  # fmt: skip
            for cls_index, cls in enumerate(("high", "normal", "low")):
                client.submit_many(jobs[cls_index::3], cls)
        progress(f"{args.jobs} jobs posted; sampling the worker's memory while they drain")
        start = time.monotonic()
        while time.monotonic() - start < args.timeout:
            worker.check_alive()
            done = finished_count(settings, prefix)
            samples.append((time.monotonic() - start, done, *rss_mib(worker.pid)))
            if done >= args.jobs:
                break
            time.sleep(1.0)
    finally:
        worker.stop()
        delete_private_topics(settings)
    steady = [(done, w, r) for _, done, w, r in samples if done >= args.jobs * 0.1]  # after the first fill
    marks = []
    for fraction in (0.1, 0.5, 0.9, 1.0):
        at = next((s for s in samples if s[1] >= args.jobs * fraction), samples[-1])
        marks.append((f"{fraction:.0%}", at[1], round(at[0], 1), round(at[2], 1), round(at[3], 1)))
    slope = slope_mib_per_1k_jobs([(done, w) for done, w, _ in steady])
    relay_slope = slope_mib_per_1k_jobs([(done, r) for done, _, r in steady])
    print(format_table(["drained", "jobs done", "s", "worker RSS MiB", "relay RSS MiB"], marks))
    print(
        f"RSS slope after the first 10%: worker {slope:+.2f}, relay {relay_slope:+.2f} MiB per 1,000 jobs "
        f"(max-waiting {args.max_waiting})"
    )
    write_json(
        args.json,
        {
            "jobs": args.jobs,
            "max_waiting": args.max_waiting,
            "samples": samples,
            "marks": marks,
            "rss_slope_mib_per_1k_jobs": slope,
            "relay_rss_slope_mib_per_1k_jobs": relay_slope,
            "drained": bool(samples) and samples[-1][1] >= args.jobs,
        },
    )
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", type=int, default=3000, help="backlog size (default: 3000)")
    parser.add_argument("--max-waiting", type=int, default=32, help="the worker's cap (default: 32)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "backlog.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e.backlog", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
