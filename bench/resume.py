"""`python -m bench.resume` (`inferq bench resume`): a long job whose worker is killed -9 half-way, resumed by
the other worker from the tokens it saved, against the same job restarted from scratch (its saved progress
deleted right after the kill, so the other worker finds none), alternated in one run.

Two workers of one private deployment serve the model with their default options. Each round posts one job
of `--tokens` tokens (greedy, its EOS suppressed with logit_bias so that it runs to the end), waits until
it has saved half of them (job_progress_summary), kills the worker holding it with SIGKILL, and times the
kill to the job's terminal row (its `finished_at`): the group's detection of the death (the consumer session
timeout, 10 s) is in both. The killed worker is started again before the next round. Rounds alternate
between the two kinds (resume first, then restart first). Reported per round and as medians: seconds from
the kill to done, tokens saved at the kill, and the ratio resumed / restarted (bar: at most 0.65 for a
1,000-token job with the default model); every round's output must be the same text. Table and JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.report import default_json_path, fmt, format_table, median, progress, ratio, write_json

BAR_RATIO = 0.65
PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a map in a bottle."
KINDS = ("resume", "restart")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="the workers' model (default: smollm2)")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens of the job (default: 1000)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each kind (default: 2)")
    parser.add_argument(
        "--threads", type=int, default=None, help="the workers' OMP_NUM_THREADS (default: unset, as deployed)"
    )
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per round (default: 1800)")
    parser.add_argument(
        "--save-cost-only", action="store_true", help="only the cost of saving progress (no workers, seconds)"
    )
    parser.add_argument("--json", type=Path, default=None, help="default: bench/results/resume-*.json")
    parser.add_argument("worker_args", nargs="*", default=[], help="after --: more `inferq worker` options")


class Fleet:
    """Two workers on a private deployment; a killed one is replaced by a new process."""

    def __init__(self, settings: Any, args: argparse.Namespace, logs: Path) -> None:
        self.settings, self.args, self.logs = settings, args, logs
        self.procs: dict[str, subprocess.Popen] = {}
        self._started = 0
        for _ in range(2):
            self.start()
        self.wait_members()

    def start(self) -> str:
        self._started += 1
        worker_id = f"{self.settings.topic_prefix}-w{self._started}"
        s = self.settings
        env = {**os.environ, "INFERQ_TOPIC_PREFIX": s.topic_prefix, "INFERQ_KAFKA": s.kafka,
               "INFERQ_DATABASE_URL": s.database_url}  # fmt: skip
        if self.args.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.args.threads)
        cmd = [sys.executable, "-m", "workers.cli", "worker", "--worker-id", worker_id,
               "--model", self.args.model, *self.args.worker_args]  # fmt: skip
        with (self.logs / f"{worker_id}.log").open("wb") as out:
            self.procs[worker_id] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        return worker_id

    def wait_members(self, timeout_s: float = 600.0) -> None:
        from workers.services.kafka import wait_for_workers

        wait_for_workers(self.settings, 2, timeout_s, self.check_alive)

    def check_alive(self) -> None:
        for worker_id, proc in self.procs.items():
            if proc.poll() is not None and proc.returncode != -signal.SIGKILL:
                raise RuntimeError(f"worker {worker_id} exited with {proc.returncode}: see {self.logs}")

    def kill(self, worker_id: str) -> float:
        """SIGKILL the worker; the wall time it was sent."""
        proc = self.procs.pop(worker_id)
        at = time.time()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return at

    def close(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def eos_bias(model: str) -> dict[str, float]:
    """logit_bias that keeps the model from ending the job before its last token."""
    from gpu.generation_config import eos_token_ids
    from gpu.model import load_model

    loaded = load_model(model)
    eos = eos_token_ids(getattr(loaded.model, "generation_config", None), loaded.tokenizer)
    return {str(t): -100.0 for t in sorted(eos)}


SAVED = "SELECT coalesce(sum(tokens), 0) FROM job_progress_summary WHERE job_id = :j"
HOLDER = "SELECT worker_id FROM jobs WHERE job_id = :j"
ROW = "SELECT status, finished_at, attempts, completion_tokens, output_text FROM jobs WHERE job_id = :j"


def streamed_before(settings: Any, job_id: str, since_ms: int, attempt: int = 1) -> int:
    """Tokens the job's `attempt` sent on its stream (read until the job's final event is in)."""
    from workers.client.token_events import TokenEventReader

    reader = TokenEventReader(settings, since_ms, "inferq-bench-resume")
    sent, deadline = 0, time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            events = [e for e in reader.poll(0.5) if e.job_id == job_id]
            sent = max([sent] + [e.offset + len(e.token_ids) for e in events if e.attempt == attempt])
            if any(e.final for e in events):
                break
    finally:
        reader.close()
    return sent


def one_round(fleet: Fleet, db: Any, client: Any, job: dict, kind: str, timeout_s: float) -> dict[str, Any]:
    from sqlalchemy import text

    job_id = job["job_id"]
    since_ms = int(time.time() * 1000) - 1000
    client.submit(job, "high")
    deadline = time.monotonic() + timeout_s
    half = job["max_tokens"] // 2
    saved = 0
    while saved < half:  # half-way: half of its tokens are saved
        fleet.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{job_id}: {saved} of {half} tokens saved after {timeout_s:.0f}s")
        time.sleep(0.05)
        with db.connect() as conn:
            saved = conn.execute(text(SAVED), {"j": job_id}).scalar_one()
    with db.connect() as conn:
        holder = conn.execute(text(HOLDER), {"j": job_id}).scalar_one()
    killed_at = fleet.kill(holder)
    time.sleep(0.5)  # a commit on its way when it died has landed
    with db.begin() as conn:
        saved = conn.execute(text(SAVED), {"j": job_id}).scalar_one()
        if kind == "restart":  # the other worker finds nothing to resume from (before its session noticed)
            conn.execute(text("DELETE FROM job_progress WHERE job_id = :j"), {"j": job_id})
    progress(f"  {kind}: killed {holder} with {saved} tokens saved")
    while True:
        fleet.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{job_id} not done {timeout_s:.0f}s after it was posted")
        with db.connect() as conn:
            row = conn.execute(text(ROW), {"j": job_id}).one()
        if row.finished_at is not None:
            break
        time.sleep(0.2)
    fleet.start()  # the replacement, once the job is done: its start-up would share the cores with it
    streamed = streamed_before(fleet.settings, job_id, since_ms)
    fleet.wait_members()
    return {
        "kind": kind,
        "job_id": job_id,
        "status": row.status,
        "attempts": row.attempts,
        "completion_tokens": row.completion_tokens,
        "saved_at_kill": int(saved),
        # what the killed worker had streamed past its last save: lost, generated again (a lower bound of
        # what it had generated: its stream lags by up to the coalescing interval)
        "lost_at_kill": max(0, streamed - int(saved)),
        "kill_to_done_s": (row.finished_at - datetime.fromtimestamp(killed_at, UTC)).total_seconds(),
        "output": row.output_text,
    }


def save_costs(settings: Any) -> list[dict[str, Any]]:
    """What one save pass costs (workers/cli/bench_progress.py, in a process of its own: the worker's code),
    for passes of jobs decoding ~20 tokens/s each (this CPU) and ~100 (a GPU), every 250 ms."""
    env = {
        **os.environ,
        "INFERQ_TOPIC_PREFIX": settings.topic_prefix,
        "INFERQ_DATABASE_URL": settings.database_url,
    }
    cmd = [sys.executable, "-m", "workers.cli.bench_progress", "8,64,256", "5,25"]
    return json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)


def run(args: argparse.Namespace) -> int:
    import tempfile

    from sqlalchemy import create_engine

    from bench.machine import machine_info
    from workers.client import JobClient
    from workers.services.kafka import delete_topics, ensure_topics
    from workers.settings import Settings

    base = Settings.from_env()
    settings = dataclasses.replace(base, topic_prefix=f"bench{uuid.uuid4().hex[:10]}")
    ensure_topics(settings.kafka_connection, settings.topic_partitions(), settings.replication_factor)
    logs = Path(tempfile.gettempdir()) / f"inferq-{settings.topic_prefix}"
    logs.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    costs = save_costs(settings)
    print(render_costs(costs))
    if args.save_cost_only:
        delete_topics(settings.kafka_connection, settings.topic_prefix)
        write_json(args.json or default_json_path("resume"), {"save_cost": costs})
        return 0
    bias = eos_bias(args.model)
    progress(f"starting two workers ({args.model}); logs in {logs}")
    fleet = Fleet(settings, args, logs)
    db = create_engine(settings.database_url)
    client = JobClient(settings)
    rounds: list[dict[str, Any]] = []
    try:
        for n in range(args.rounds):
            for kind in KINDS if n % 2 == 0 else KINDS[::-1]:
                job = {"job_id": f"{settings.topic_prefix}-{kind}-{n}", "prompt": PROMPT, "temperature": 0,
                       "max_tokens": args.tokens, "logit_bias": bias}  # fmt: skip
                progress(f"round {n + 1}, {kind}: a {args.tokens}-token job")
                rounds.append(one_round(fleet, db, client, job, kind, args.timeout_s))
                progress(f"  {kind}: done {rounds[-1]['kill_to_done_s']:.1f} s after the kill")
    finally:
        client.close()
        fleet.close()
        db.dispose()
        delete_topics(settings.kafka_connection, settings.topic_prefix)
    medians = {k: median(r["kill_to_done_s"] for r in rounds if r["kind"] == k) for k in KINDS}
    payload = {
        "rounds": [{k: v for k, v in r.items() if k != "output"} for r in rounds],
        "save_cost": costs,
        "medians_s": medians,
        "ratio": ratio(medians["resume"], medians["restart"]),
        "bar": BAR_RATIO,
        "same_output": len({r["output"] for r in rounds}) == 1,
        "all_succeeded": all(r["status"] == "succeeded" and r["attempts"] == 2 for r in rounds),
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "machine": {**machine_info(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(render(payload))
    print(f"\nresults: {write_json(args.json or default_json_path('resume'), payload)}")
    return 0 if payload["all_succeeded"] and payload["same_output"] else 1


def render_costs(costs: list[dict[str, Any]]) -> str:
    rows = [(c["jobs"], c["tokens_per_job"], c["pass_wall_ms"], c["pass_cpu_ms"], c["wall_us_per_token"],
             c["cpu_us_per_token"]) for c in costs]  # fmt: skip
    headers = ["jobs", "tokens/job", "pass wall ms", "pass CPU ms", "wall us/token", "CPU us/token"]
    title = "saving progress: one pass's statement, as the persister writes it (its commit shared, not timed)"
    return title + "\n" + format_table(headers, rows, 2)


def render(payload: dict[str, Any]) -> str:
    keys = ("kind", "saved_at_kill", "lost_at_kill", "kill_to_done_s", "status", "attempts")
    keys += ("completion_tokens",)
    rows = [[r[k] for k in keys] for r in payload["rounds"]]
    headers = ["kind", "saved at kill", "lost at kill", "kill to done s", "status", "attempts", "tokens"]
    table = format_table(headers, rows)
    m, r = payload["medians_s"], payload["ratio"]
    verdict = "meets" if r is not None and r <= payload["bar"] else "misses"
    return (
        f"{table}\n\nmedian kill to done: resumed {fmt(m['resume'])} s, restarted {fmt(m['restart'])} s; "
        f"ratio {fmt(r, 2)} ({verdict} the bar of {payload['bar']}); "
        f"same output every round: {payload['same_output']}"
    )


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
