"""`python -m bench.pipeline` (`inferq bench pipeline`): short jobs through Kafka, one worker and PostgreSQL
beside the engine alone on the same jobs, with the real engine and with an instant one.

For each engine (`real`: the model; `instant`: its forward stubbed, fixed logits, so what is left is the
worker's own ceiling) and each workload (`--jobs` one-token jobs, `--long-jobs` jobs of `--long-tokens`
tokens; prompts of `--prompt-len` tokens): the engine alone in this process (all jobs added at once,
stepped to the end, the worker's engine options), then the same jobs posted at once to a private
deployment served by one worker (`workers.cli.bench_worker`), timed from the first post until every row is
terminal. Reported: jobs/s, tokens/s, token events/s (the tokens topic's growth), the worker's CPU ms per
job by thread (its token-event relay process and its engine's process included), and database statements,
round trips and transactions per job (counted in the worker by SQLAlchemy events). Table, JSON and PNG.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import default_json_path, format_table, progress, ratio, write_json

PRINTABLE = "".join(chr(c) for c in range(33, 127))
TERMINAL = "('succeeded', 'failed', 'rejected', 'cancelled', 'expired')"
BAR_JOBS_S, BAR_INSTANT_JOBS_S, BAR_VS_ENGINE = 1500.0, 3000.0, 0.7


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", type=int, default=4000, help="one-token jobs (default: 4000; bar: 8000)")
    parser.add_argument("--long-jobs", type=int, default=400, help="longer jobs (default: 400; 0: none)")
    parser.add_argument("--long-tokens", type=int, default=32, help="tokens of a longer job (default: 32)")
    parser.add_argument("--prompt-len", default="4:8", help="prompt tokens, min:max (default: 4:8)")
    parser.add_argument("--engines", default="real,instant", help="real, instant or both (default: both)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides (default: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the jobs' `stream`: token events as they generate (default), or only their results",
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per workload, through the worker")
    parser.add_argument("--json", type=Path, default=None, help="default: bench/results/pipeline-*.json")
    parser.add_argument(
        "worker_args", nargs="*", default=[], help="after --: more `inferq worker` options, both engines"
    )


def stub_forward(engine: Any, stub_type: type) -> None:
    """The engine's forward replaced by `stub_type` (bench.host_overhead.steps.StubForward): one printable
    token."""
    token = engine.tokenizer.encode("a")[-1]
    if token in engine.eos_token_ids:
        raise ValueError(f"stub token {token} is an EOS token")
    rows = engine.scheduler.config.max_num_batched_tokens
    engine.runner.forward = stub_type(engine.model.config.vocab_size, token, rows)


def make_jobs(
    count: int, prompt_len: tuple[int, int], max_tokens: int, seed: str, tag: str, stream: bool = True
) -> list[dict]:
    """Jobs of random printable text (the byte tokenizer: n characters are n+1 tokens): no prefix hits."""
    rng = random.Random(seed)
    return [
        {
            "job_id": f"{tag}-{i:05d}",
            "prompt": "".join(rng.choice(PRINTABLE) for _ in range(max(1, rng.randint(*prompt_len) - 1))),
            "max_tokens": max_tokens,
            "stream": stream,
        }
        for i in range(count)
    ]


# ---- the engine alone ---------------------------------------------------------------------------


# the worker's engine defaults (inferq worker --max-num-seqs, --max-num-batched-tokens)
ENGINE_OPTIONS = {"max_num_seqs": 64, "max_num_batched_tokens": 1024}


def engine_alone(engine: Any, jobs: list[dict]) -> dict[str, float]:
    from bench.e2e.phases import engine_run

    class _Job:  # what engine_run reads
        def __init__(self, job: dict) -> None:
            self.job_id, self.prompt, self.max_tokens = job["job_id"], job["prompt"], job["max_tokens"]

    steps_before = engine.stats().steps
    cpu = time.process_time()
    tokens, wall = engine_run(engine, [_Job(j) for j in jobs])
    cpu = time.process_time() - cpu
    out = {"jobs": len(jobs), "wall_s": wall, "jobs_s": len(jobs) / wall, "tokens_s": tokens / wall,
           "tokens": tokens, "cpu_ms_per_job": 1000 * cpu / len(jobs)}  # fmt: skip
    out["steps"] = engine.stats().steps - steps_before
    out["jobs_per_step"] = len(jobs) / max(1, out["steps"])
    return out


# ---- through the worker ---------------------------------------------------------------------------


class Deployment:
    """A private prefix, one worker on it, and what is needed to watch it."""

    def __init__(
        self, settings: Any, instant: bool, threads: int, model: str, worker_args: list[str]
    ) -> None:
        from bench.e2e.deploy import WorkerProcess, wait_joined

        self.settings = settings
        tmp = Path(tempfile.gettempdir()) / f"inferq-{settings.topic_prefix}"
        tmp.mkdir(parents=True, exist_ok=True)
        self.stats_path = tmp / f"stats-{'instant' if instant else 'real'}.json"
        log = tmp / f"worker-{'instant' if instant else 'real'}.log"
        env = {"INFERQ_BENCH_STATS": str(self.stats_path), "INFERQ_BENCH_INSTANT": "1" if instant else "0"}
        if os.environ.get("INFERQ_BENCH_PROFILE"):  # the loop's cProfile stats, one file per engine kind
            kind = "instant" if instant else "real"
            env["INFERQ_BENCH_PROFILE"] = f"{os.environ['INFERQ_BENCH_PROFILE']}.{kind}"
        self.worker = WorkerProcess(
            settings, log, threads, ["--model", model, *worker_args], ("-m", "workers.cli.bench_worker"), env
        )
        self.log = log
        wait_joined(settings, self.worker)
        from sqlalchemy import create_engine

        from workers.client import JobClient

        self.db = create_engine(settings.database_url)
        # one producer for every run, as a producer service has: the first run (the warm-up) fetches the
        # topic's metadata and connects, so a measured run's clock holds none of that
        self.client = JobClient(settings)

    def finished(self, prefix: str) -> int:
        from sqlalchemy import text

        sql = f"SELECT count(*) FROM jobs WHERE job_id LIKE :p AND status IN {TERMINAL}"
        with self.db.connect() as conn:
            return int(conn.execute(text(sql), {"p": f"{prefix}-%"}).scalar_one())

    def token_events(self) -> int:
        """Records on the deployment's tokens topic so far (end offsets summed)."""
        from workers.services.kafka import topic_records

        return topic_records(self.settings.kafka_connection, self.settings.topics.tokens)

    def snapshot(self) -> dict[str, Any]:
        import psutil

        from bench.e2e.deploy import pid_cpu_s

        for _ in range(20):  # the worker rewrites it every 0.25 s
            try:
                stats = json.loads(self.stats_path.read_text())
                break
            except (OSError, ValueError):
                time.sleep(0.05)
        else:
            stats = {"threads": {}, "db": {}}
        try:
            children = psutil.Process(self.worker.pid).children(recursive=True)
        except psutil.Error:
            children = []
        threads = dict(stats["threads"])
        for child in children:  # the token-event relay, and the engine's own process when it has one
            try:
                name = "engine process" if "spawn_main" in " ".join(child.cmdline()) else "relay process"
            except psutil.Error:
                continue
            threads[name] = threads.get(name, 0.0) + (pid_cpu_s(child.pid) or 0.0)
        try:
            loop = self.worker.loop_seconds()
        except OSError:
            loop = {}
        return {"t": time.monotonic(), "threads": threads, "db": stats["db"], "events": self.token_events(),
                "loop": loop}  # fmt: skip

    def run(self, jobs: list[dict], prefix: str, timeout_s: float) -> dict[str, Any]:
        from bench.e2e.deploy import MachineBusy
        from schemas.jobs import JobRequest

        # the jobs as a producer holds them before it posts: the clock starts at the first post
        requests = [JobRequest.model_validate(job) for job in jobs]
        # this process holds the engine-alone runs' and earlier workloads' objects: out of the collector's
        # way (as the worker keeps its start-up objects), or its collections slow the posting of a later run
        gc.collect()
        gc.freeze()
        time.sleep(0.6)  # the stats file catches up with the idle worker
        before = self.snapshot()
        busy = MachineBusy()  # every process: PostgreSQL, the broker and this client share the cores
        start = time.monotonic()
        self.client.submit_many(requests, "normal")
        posted_s = time.monotonic() - start
        done = 0
        while done < len(jobs):
            self.worker.check_alive()
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"{done} of {len(jobs)} jobs terminal after {timeout_s:.0f}s")
            time.sleep(0.1)
            done = self.finished(prefix)
        wall = time.monotonic() - start
        machine_cpu_s = busy.cpu_s()
        time.sleep(0.6)
        after = self.snapshot()
        n = len(jobs)
        tokens = sum(j["max_tokens"] for j in jobs)
        cpu = {k: 1000 * (after["threads"].get(k, 0.0) - before["threads"].get(k, 0.0)) / n
               for k in after["threads"]}  # fmt: skip
        db = {k: (after["db"].get(k, 0) - before["db"].get(k, 0)) / n for k in after["db"]}
        events = after["events"] - before["events"]
        loop = {k: 1000 * (v - before["loop"].get(k, 0.0)) / n for k, v in after["loop"].items()}
        steps = db.pop("engine_steps", 0) * n
        return {
            "jobs": n,
            "wall_s": wall,
            "post_s": posted_s,
            "jobs_s": n / wall,
            "tokens_s": tokens / wall,
            "token_events": events,
            "token_events_s": events / wall,
            "cpu_ms_per_job": {k: v for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v > 0.005},
            "cpu_ms_per_job_total": sum(cpu.values()),
            # the worker's own process: what a deployment with PostgreSQL and Kafka elsewhere would see
            "process_cpu_ms_per_job": sum(v for k, v in cpu.items() if k not in CHILD_PROCESSES),
            "machine": machine_share(machine_cpu_s, wall, n, os.cpu_count() or 1),
            "db_per_job": db,
            # the engine loop's wall ms per job by phase (idle: waiting for records or decisions)
            "loop_ms_per_job": {k: v for k, v in loop.items() if v > 0.005},
            "steps": steps,
            "jobs_per_step": n / steps if steps else None,
        }

    def close(self) -> None:
        from bench.e2e.deploy import delete_private_topics

        self.worker.stop()
        self.client.close()
        self.db.dispose()
        delete_private_topics(self.settings)


CHILD_PROCESSES = ("engine process", "relay process")  # the worker's children, counted apart in `snapshot`


def machine_share(cpu_s: float | None, wall_s: float, jobs: int, cores: int) -> dict[str, float | None]:
    """The whole machine over a run: CPU ms per job of every process, cores busy on average, and the jobs/s
    the machine could not pass at that cost even with every core busy all the time (its ceiling)."""
    if cpu_s is None or jobs <= 0 or wall_s <= 0:
        return {"cpu_ms_per_job": None, "cores_busy": None, "ceiling_jobs_s": None}
    per_job = 1000 * cpu_s / jobs
    return {
        "cpu_ms_per_job": per_job,
        "cores_busy": cpu_s / wall_s,
        "ceiling_jobs_s": cores * 1000 / per_job if per_job > 0 else None,
    }


# ---- the run --------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    from bench.e2e.deploy import make_private_settings
    from bench.host_overhead.steps import StubForward
    from bench.machine import machine_info
    from gpu.engine import Engine
    from workers.settings import Settings

    torch.set_num_threads(args.threads)
    lo, hi = (int(v) for v in args.prompt_len.split(":"))
    kinds = [k.strip() for k in args.engines.split(",") if k.strip()]
    base = Settings.from_env()
    streamed = "" if args.stream else "-no-stream"  # in job ids too: a name without spaces
    workloads = [(f"1-token{streamed}", args.jobs, 1)]
    if args.long_jobs:
        workloads.append((f"{args.long_tokens}-token{streamed}", args.long_jobs, args.long_tokens))
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    for kind in kinds:
        # a deployment of its own for each engine: closing one deletes its topics, and the next worker on
        # that prefix would run on topics the broker re-creates with one partition (that one came out 5-15%
        # slower, whichever engine it was)
        settings = make_private_settings(base)
        run_id = settings.topic_prefix
        progress(f"{kind} engine: the engine alone")
        engine = Engine.from_options(args.model, cache_dir=settings.cache_dir, **ENGINE_OPTIONS)
        if kind == "instant":
            stub_forward(engine, StubForward)
        engine_alone(engine, make_jobs(64, (lo, hi), 4, f"{args.seed}:warm", f"{run_id}-{kind}-warm-engine"))
        alone = {}
        for name, count, tokens in workloads:
            jobs = make_jobs(count, (lo, hi), tokens, f"{args.seed}:{name}", f"{run_id}-{kind}-{name}-engine")
            alone[name] = engine_alone(engine, jobs)
        del engine
        progress(f"{kind} engine: starting the worker")
        deployment = Deployment(settings, kind == "instant", args.threads, args.model, args.worker_args)
        try:
            warm = make_jobs(64, (lo, hi), 4, f"{args.seed}:warm", f"{run_id}-{kind}-warm")
            deployment.run(warm, f"{run_id}-{kind}-warm", args.timeout_s)
            for name, count, tokens in workloads:
                prefix = f"{run_id}-{kind}-{name}"
                progress(f"{kind} engine: {count} {name} jobs through the worker")
                jobs = make_jobs(count, (lo, hi), tokens, f"{args.seed}:{name}", prefix, args.stream)
                worker = deployment.run(jobs, prefix, args.timeout_s)
                rows.append({"engine": kind, "workload": name, "alone": alone[name], "worker": worker,
                             "vs_engine": ratio(worker["jobs_s"], alone[name]["jobs_s"])})  # fmt: skip
                progress(f"  {worker['jobs_s']:.0f} jobs/s (engine alone {alone[name]['jobs_s']:.0f})")
        finally:
            deployment.close()
    payload = {
        "rows": rows,
        "bars": {"jobs_s": BAR_JOBS_S, "instant_jobs_s": BAR_INSTANT_JOBS_S, "vs_engine": BAR_VS_ENGINE},
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "machine": {**machine_info(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(render(payload))
    path = write_json(args.json or default_json_path("pipeline"), payload)
    from bench.plots import png_path, write_or_explain

    print(f"\nresults: {path}\n{write_or_explain(figure, payload, png_path(path))}")
    return 0


def render(payload: dict) -> str:
    headers = ["engine / jobs", "alone jobs/s", "worker jobs/s", "ratio", "jobs/step alone",
               "jobs/step worker", "tokens/s", "events/s", "worker CPU ms/job", "stmts/job",
               "round trips/job", "tx/job"]  # fmt: skip
    table, machine = [], []
    for r in payload["rows"]:
        w = r["worker"]
        db = w["db_per_job"]
        table.append([f"{r['engine']} / {r['workload']}", r["alone"]["jobs_s"], w["jobs_s"], r["vs_engine"],
                      r["alone"]["jobs_per_step"], w["jobs_per_step"], w["tokens_s"], w["token_events_s"],
                      w["cpu_ms_per_job_total"], db.get("statements"), db.get("round_trips"),
                      db.get("transactions")])  # fmt: skip
        m = w.get("machine", {})
        machine.append([f"{r['engine']} / {r['workload']}", w.get("process_cpu_ms_per_job"),
                        m.get("cpu_ms_per_job"), m.get("cores_busy"), m.get("ceiling_jobs_s")])  # fmt: skip
    cores = payload.get("machine", {}).get("cpu_count")
    lines = [format_table(headers, table, digits=2), "",
             f"CPU per job: the worker's own process, and every process of the machine ({cores} cores: "
             "PostgreSQL, the broker and this client too); ceiling: jobs/s at that cost, every core busy:",
             format_table(["engine / jobs", "worker process ms/job", "machine ms/job", "cores busy",
                           "machine ceiling jobs/s"], machine, digits=2),
             "", "worker CPU ms per job, by thread:"]  # fmt: skip
    names = sorted({k for r in payload["rows"] for k in r["worker"]["cpu_ms_per_job"]})
    by_thread = [[n, *(r["worker"]["cpu_ms_per_job"].get(n) for r in payload["rows"])] for n in names]
    cols = ["thread", *(f"{r['engine']}/{r['workload']}" for r in payload["rows"])]
    lines.append(format_table(cols, by_thread, digits=3))
    lines += ["", "engine loop wall ms per job, by phase:"]
    phases = sorted({k for r in payload["rows"] for k in r["worker"].get("loop_ms_per_job", {})})
    by_phase = [[p, *(r["worker"].get("loop_ms_per_job", {}).get(p) for r in payload["rows"])]
                for p in phases]  # fmt: skip
    lines.append(format_table(["phase", *cols[1:]], by_phase, digits=3))
    bars = payload["bars"]
    lines.append(
        f"bars (8,000 one-token jobs): real >= {bars['jobs_s']:,.0f} jobs/s and >= {bars['vs_engine']} of "
        f"the engine alone; instant >= {bars['instant_jobs_s']:,.0f} jobs/s"
    )
    return "\n".join(lines)


def figure(payload: dict, path: Path) -> Path:
    from bench.plots import _pyplot

    plt = _pyplot()
    rows = payload["rows"]
    fig, (ax, cx) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r['engine']}\n{r['workload']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["alone"]["jobs_s"] for r in rows], 0.4, label="engine alone")
    ax.bar([x + 0.2 for x in xs], [r["worker"]["jobs_s"] for r in rows], 0.4, label="through the worker")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("jobs/s")
    ax.set_title("jobs/s: engine alone vs Kafka -> worker -> PostgreSQL")
    ax.legend()
    names = sorted({k for r in rows for k in r["worker"]["cpu_ms_per_job"]})
    bottom = [0.0] * len(rows)
    for name in names:
        vals = [r["worker"]["cpu_ms_per_job"].get(name, 0.0) for r in rows]
        cx.bar(list(xs), vals, 0.6, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    cx.set_xticks(list(xs), labels)
    cx.set_ylabel("worker CPU ms per job")
    cx.set_title("worker CPU per job, by thread")
    cx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
