"""`python -m workers.cli.bench_progress JOBS TOKENS`: what one save pass of running jobs' progress costs,
written as the persister writes it, on the deployment's database (INFERQ_DATABASE_URL, INFERQ_TOPIC_PREFIX);
prints one JSON object per (jobs, tokens) pair as a list. `inferq bench resume` runs it (bench/ uses the
worker's code only through a process of its own)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import UTC, datetime
from typing import Any

from schemas.job_key import JobKey
from workers.db.connect import make_engine
from workers.db.jobs import Admission, admit
from workers.db.progress import ProgressChunk, drop_progress
from workers.serving.outbox.writes import Progress, WriteContext, apply_all
from workers.settings import Settings


def save_cost(settings: Settings, jobs: int, tokens: int, passes: int = 30) -> dict[str, Any]:
    """One save pass of `jobs` running jobs with `tokens` new tokens each, written as the persister writes
    it (apply_all of one Progress item) inside a transaction, as in the worker it rides in its batch's (the
    commit, shared with the batch's other writes, is not timed): the median wall time of the statement,
    this process's CPU (building the array literals, the driver), and both per token."""
    db = make_engine(settings.database_url)
    tag = f"{settings.topic_prefix}-cost{jobs}x{tokens}"
    now = datetime.now(UTC)
    source = (settings.topics.jobs("normal"), 0, 0)
    rows = [Admission(f"{tag}-{i}", "bench", "normal", "p", {"seed": 1}, None, now, now, "bench", source)
            for i in range(jobs)]  # fmt: skip
    with db.begin() as conn:
        admit(conn, rows)
    walls, cpus = [], []
    try:
        for n in range(passes):
            chunks = tuple(
                ProgressChunk(
                    f"{tag}-{i}",
                    "bench",
                    0,
                    1,
                    n * tokens,
                    tuple(range(300, 300 + tokens)),
                    "four" * tokens,
                    "f" * 32,
                )  # fmt: skip
                for i in range(jobs)
            )
            with db.begin() as conn:
                conn.exec_driver_sql("SELECT 1")  # the transaction is open: its BEGIN is not timed
                wall, cpu = time.perf_counter(), time.process_time()
                apply_all(conn, [Progress(chunks)], WriteContext("bench", datetime.now(UTC)))
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
    finally:
        with db.begin() as conn:  # (the queued rows stay, as a bench deployment's do)
            drop_progress(conn, [JobKey("bench", r.job_id) for r in rows])
        db.dispose()
    wall_ms, cpu_ms = 1000 * statistics.median(walls), 1000 * statistics.median(cpus)
    per = 1000 / (jobs * tokens)
    return {"jobs": jobs, "tokens_per_job": tokens, "pass_wall_ms": wall_ms, "pass_cpu_ms": cpu_ms,
            "wall_us_per_token": wall_ms * per, "cpu_us_per_token": cpu_ms * per}  # fmt: skip


def main(argv: list[str]) -> int:
    settings = Settings.from_env()
    jobs, tokens = ([int(v) for v in arg.split(",")] for arg in argv)
    print(json.dumps([save_cost(settings, j, t) for j in jobs for t in tokens]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
