"""Running `bench e2e`: a private deployment, the engine in this process, then the three measurements."""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from bench.e2e.deploy import (
    MachineBusy,
    TokenRecorder,
    WorkerProcess,
    delete_private_topics,
    local_kafka_pid,
    make_private_settings,
    pid_cpu_s,
    wait_joined,
)
from bench.e2e.phases import (
    Session,
    engine_run,
    make_jobs,
    random_lengths,
    summarize_poisson,
    ttfts,
    workload_lengths,
)
from bench.e2e.report import BAR_E2E_VS_ENGINE, BAR_HIGH_TTFT_RATIO, render
from bench.e2e.rows import ttft_breakdown
from bench.e2e.stats import per_job, percentile, throughput
from bench.report import median, progress, ratio
from bench.workload import WorkloadSpec, parse_range

# the worker's engine defaults (`inferq worker` without options), so both sides run the same engine
ENGINE_OPTIONS = {"max_num_seqs": 64, "max_num_batched_tokens": 1024}
LOOP_METRICS_PERIOD_S = 1.2  # a little over how often the worker publishes its loop counters (1 s)
T = TypeVar("T")
ITL_DEFINITION = "per job: (last - first event arrival) / tokens after the first event"


def run_e2e_bench(args: argparse.Namespace, worker_args: list[str]) -> tuple[dict[str, object], str]:
    import torch

    from bench.machine import machine_info
    from gpu.engine import Engine
    from workers.client import JobClient
    from workers.settings import Settings

    counts = thread_counts(args.threads)
    torch.set_num_threads(counts[0])
    phases = {p.strip() for p in args.phases.split(",") if p.strip()}
    if "saturation" not in phases:
        args.reps = 0
    spec = WorkloadSpec(args.requests, parse_range(args.prompt_len), parse_range(args.output_len), args.seed)
    load_before = os.getloadavg()
    settings = make_private_settings(Settings.from_env())
    log = Path(tempfile.gettempdir()) / f"inferq-{settings.topic_prefix}" / "worker.log"
    extra = ["--model", args.model, *worker_args]
    progress(f"prefix {settings.topic_prefix}: starting the worker (log {log}) and loading the engine here")
    worker = WorkerProcess(settings, log, counts[0], extra)
    recorder = client = None
    errors: list[str] = []  # a failed later phase still leaves the saturation numbers on file
    try:
        # one after the other: each measures its kernels at start, and must not do it while the other does
        wait_joined(settings, worker)
        engine = Engine.from_options(args.model, cache_dir=settings.cache_dir, **ENGINE_OPTIONS)
        recorder = TokenRecorder(settings)
        client = JobClient(settings)
        session = Session(client, recorder, worker, args.timeout_s)
        rng = random.Random(args.seed)
        run_id = settings.topic_prefix  # in every job_id: a job_id already terminal in Postgres never reruns
        progress(f"worker {worker.pid} serving; warm-up (engine, then e2e)")
        warm = random_lengths(rng, 8, (16, 64), (8, 32))
        engine_run(engine, make_jobs(warm, f"{args.seed}:warm-engine", f"{run_id}-warm-engine"))
        session.burst(make_jobs(warm, f"{args.seed}:warm-e2e", f"{run_id}-warm-e2e"))

        lengths = workload_lengths(spec, engine.model.config.vocab_size)
        sat = saturation(args, engine, session, lengths, run_id)
        walls = [w for w in sat["e2e_wall_s"] if w]
        job_rate = args.job_rate or (args.requests / median(walls) if walls else None)
        poisson, idle, loaded, load_info = [], [], [], {}
        if "poisson" in phases and job_rate:
            work = partial(poisson_rates, args, session, spec, job_rate, run_id, settings.database_url)
            poisson = _guarded(errors, "poisson", work, [])
        if "priority" in phases:
            work = partial(priority, args, session, spec, rng, run_id, settings.database_url)
            idle, loaded, load_info = _guarded(errors, "priority", work, ([], [], {}))
        by_threads = {counts[0]: sat}
        for threads in counts[1:]:  # the same saturation with another intra-op thread count on both sides
            worker.stop()
            worker = session.worker = WorkerProcess(
                settings, log.with_name(f"worker-t{threads}.log"), threads, extra
            )
            torch.set_num_threads(threads)
            wait_joined(settings, worker)
            progress(f"worker {worker.pid} serving with {threads} threads; warm-up")
            engine_run(
                engine,
                make_jobs(warm, f"{args.seed}:warm-engine-{threads}", f"{run_id}-warm-engine-t{threads}"),
            )
            session.burst(make_jobs(warm, f"{args.seed}:warm-e2e-{threads}", f"{run_id}-warm-e2e-t{threads}"))
            if "saturation" in phases:
                by_threads[threads] = saturation(args, engine, session, lengths, f"{run_id}-t{threads}")
    finally:
        if client is not None:
            client.close()
        if recorder is not None:
            recorder.close()
        code = worker.stop()
        progress(f"worker stopped (exit {code})")
        if not args.keep_topics:
            _guarded(errors, "cleanup", partial(delete_private_topics, settings), None)

    e2e_tok_s, engine_tok_s = median(sat["e2e_tok_s"]), median(sat["engine_tok_s"])
    idle_p99, loaded_p99 = percentile(idle, 99), percentile(loaded, 99)
    payload: dict[str, object] = {
        "e2e_tok_s": e2e_tok_s,
        "engine_tok_s": engine_tok_s,
        "e2e_vs_engine": ratio(e2e_tok_s, engine_tok_s),
        # the same ratio per CPU second: independent of how much of the shared machine each side got
        "e2e_vs_engine_per_cpu_s": ratio(_per_cpu(sat, "e2e"), _per_cpu(sat, "engine")),
        "saturated_job_rate_s": job_rate,
        "saturation_reps": sat,
        "threads": counts[0],
        "by_threads": {str(t): _side_by_side(reps) for t, reps in by_threads.items()},
        "poisson": poisson,
        "high_ttft_p99_idle_ms": idle_p99,
        "high_ttft_p99_loaded_ms": loaded_p99,
        "high_ttft_p99_ratio": ratio(loaded_p99, idle_p99),
        "high_ttft_idle_ms": idle,
        "high_ttft_loaded_ms": loaded,
        "priority_load": load_info,
        "bar": {"e2e_vs_engine": BAR_E2E_VS_ENGINE, "high_ttft_p99_ratio": BAR_HIGH_TTFT_RATIO},
        "params": _params(args, spec, worker_args, settings.topic_prefix),
        "machine": {**machine_info(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "worker_log": str(log),
        "errors": errors,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return payload, render(payload)


def saturation(
    args: argparse.Namespace, engine: Any, session: Session, lengths: list, run_id: str
) -> dict[str, list]:
    """Alternating repetitions: the engine alone, then the same prompts through the worker."""
    sat: dict[str, list] = {
        f"{side}_{what}": []
        for side in ("engine", "e2e")
        for what in ("tok_s", "tokens", "wall_s", "cpu_s", "loadavg_1m", "others_cpu_s")
    }
    sat["e2e_client_cpu_s"] = []  # this process (submitting, reading the tokens topic) during e2e reps
    sat["e2e_events"] = []  # token events the client received: how much coalescing there was
    sat["e2e_kafka_cpu_s"] = []  # the local broker's CPU during e2e reps (other users' traffic included)
    sat["e2e_loop_s"] = []  # the worker's engine-loop seconds by phase during each e2e rep
    kafka_pid = local_kafka_pid(session.worker.settings)
    for rep in range(args.reps):
        # one fresh set of characters per repetition, run once on each side
        jobs = make_jobs(lengths, f"{args.seed}:sat:{rep}", f"{run_id}-sat{rep}")
        label = f"rep {rep + 1}/{args.reps}"
        cpu, busy = time.process_time(), MachineBusy()
        tokens, wall = engine_run(engine, jobs)
        cpu = time.process_time() - cpu
        sat["engine_others_cpu_s"].append(_minus(busy.cpu_s(), cpu))
        _note(sat, "engine", tokens, wall, cpu, label)
        cpu, worker_cpu, busy = time.process_time(), session.worker.cpu_s(), MachineBusy()
        kafka_cpu = pid_cpu_s(kafka_pid)
        loop_before = session.worker.loop_seconds()
        traces = session.burst(jobs)
        sat["e2e_kafka_cpu_s"].append(_minus(pid_cpu_s(kafka_pid), kafka_cpu or 0.0) if kafka_cpu else None)
        cpu, worker_cpu = time.process_time() - cpu, session.worker.cpu_s() - worker_cpu
        sat["e2e_others_cpu_s"].append(_minus(busy.cpu_s(), cpu + worker_cpu))  # Kafka, Postgres included
        time.sleep(LOOP_METRICS_PERIOD_S)  # the worker publishes its loop seconds once a second
        loop_after = session.worker.loop_seconds()
        sat["e2e_loop_s"].append({k: v - loop_before.get(k, 0.0) for k, v in loop_after.items()})
        sat["e2e_client_cpu_s"].append(cpu)
        sat["e2e_events"].append(sum(len(t.arrivals) for t in traces))
        _note(sat, "e2e", *throughput(traces), worker_cpu, label)
    return sat


def poisson_rates(
    args: argparse.Namespace,
    session: Session,
    spec: WorkloadSpec,
    job_rate: float,
    run_id: str,
    database_url: str,
) -> list[dict[str, object]]:
    results = []
    for index, fraction in enumerate(float(f) for f in args.rates.split(",") if f.strip()):
        rate = fraction * job_rate
        progress(f"poisson {fraction:.0%} of saturation: {rate:.2f} jobs/s, {args.poisson_jobs} jobs")
        rng = random.Random(f"{args.seed}:poisson:{index}")
        lengths = random_lengths(rng, args.poisson_jobs, spec.prompt_len, spec.output_len)
        jobs = make_jobs(lengths, f"{args.seed}:ptext:{index}", f"{run_id}-poi{index}")
        traces = session.poisson(jobs, rate, rng)
        results.append({**summarize_poisson(rate, fraction, traces), **ttft_breakdown(database_url, traces)})
    return results


def priority(
    args: argparse.Namespace,
    session: Session,
    spec: WorkloadSpec,
    rng: random.Random,
    run_id: str,
    database_url: str,
) -> tuple[list[float], list[float], dict[str, object]]:
    """High jobs' TTFTs (ms) on the idle worker, then behind a saturating low-priority backlog."""
    high_lengths = random_lengths(rng, args.high_jobs, spec.prompt_len, (16, 16))
    progress(f"priority: {args.high_jobs} high jobs on the idle worker")
    idle_jobs = make_jobs(high_lengths, f"{args.seed}:hi-idle", f"{run_id}-hi-idle")
    idle_traces = session.spaced(idle_jobs, args.high_gap_s, "high")
    progress(f"priority: {args.backlog} low jobs ({args.backlog_output} tokens), then {args.high_jobs} high")
    backlog_lengths = random_lengths(rng, args.backlog, spec.prompt_len, (args.backlog_output,) * 2)
    backlog = make_jobs(backlog_lengths, f"{args.seed}:backlog", f"{run_id}-low")
    high = make_jobs(high_lengths, f"{args.seed}:hi-load", f"{run_id}-hi-load")
    traces, info = session.priority_under_load(backlog, high, args.high_gap_s, ENGINE_OPTIONS["max_num_seqs"])
    info["high_idle_per_job"] = per_job(idle_traces)
    info["ttft_breakdown_idle"] = ttft_breakdown(database_url, idle_traces)
    info["ttft_breakdown_loaded"] = ttft_breakdown(database_url, traces)
    return ttfts(idle_traces), ttfts(traces), info


def thread_counts(spec: str | int) -> list[int]:
    """`--threads 1,2` → [1, 2]: the first count is the run's (its numbers are the top-level results)."""
    counts = [int(t) for t in str(spec).split(",") if t.strip()]
    if not counts or min(counts) < 1:
        raise ValueError(f"--threads wants positive counts, got {spec!r}")
    return counts


def _side_by_side(sat: dict[str, list]) -> dict[str, object]:
    """One thread count's saturation: both sides' median tok/s, their ratio, and the worker's loop phases."""
    e2e, engine = median(sat["e2e_tok_s"]), median(sat["engine_tok_s"])
    phases: dict[str, float] = {}
    for rep in sat.get("e2e_loop_s", []):
        for phase, seconds in rep.items():
            phases[phase] = phases.get(phase, 0.0) + seconds / len(sat["e2e_loop_s"])
    return {
        "e2e_tok_s": e2e,
        "engine_tok_s": engine,
        "e2e_vs_engine": ratio(e2e, engine),
        "e2e_vs_engine_per_cpu_s": ratio(_per_cpu(sat, "e2e"), _per_cpu(sat, "engine")),
        "worker_loop_s_per_rep": phases,
    }


def _guarded(errors: list[str], phase: str, work: Callable[[], T], fallback: T) -> T:
    try:
        return work()
    except Exception as exc:  # noqa: BLE001 - reported in the results; the worker is stopped either way
        errors.append(f"{phase}: {type(exc).__name__}: {exc}")
        progress(f"{phase} failed: {exc}")
        return fallback


def _minus(total: float | None, own: float) -> float | None:
    return None if total is None else max(0.0, total - own)


def _per_cpu(sat: dict[str, list], side: str) -> float | None:
    """Median tokens per CPU second of one side."""
    pairs = zip(sat[f"{side}_tokens"], sat[f"{side}_cpu_s"], strict=True)
    return median(tokens / cpu for tokens, cpu in pairs if cpu)


def _note(sat: dict[str, list], side: str, tokens: int, wall: float | None, cpu_s: float, label: str) -> None:
    """One repetition of one side; CPU seconds (the engine: this process; e2e: the worker process) tell
    the cost apart from the share of the shared CPUs a process happened to get."""
    tok_s = tokens / wall if wall else None
    for key, value in (("tokens", tokens), ("wall_s", wall), ("tok_s", tok_s), ("cpu_s", cpu_s)):
        sat[f"{side}_{key}"].append(value)
    sat[f"{side}_loadavg_1m"].append(os.getloadavg()[0])
    progress(
        f"{label} {side}: {tokens} tokens in {wall or float('nan'):.2f} s = {tok_s or 0:,.0f} tok/s"
        f" ({cpu_s:.1f} CPU s)"
    )


def _params(args: argparse.Namespace, spec: WorkloadSpec, worker_args: list[str], prefix: str) -> dict:
    names = ("reps", "rates", "poisson_jobs", "backlog", "backlog_output", "high_jobs", "high_gap_s", "model",
             "threads", "timeout_s")  # fmt: skip
    return {
        "workload": spec.to_dict(),
        **{name: getattr(args, name) for name in names},
        "engine_options": ENGINE_OPTIONS,
        "worker_args": worker_args,
        "topic_prefix": prefix,
        "itl": ITL_DEFINITION,
    }
