"""`inferq worker`: consume jobs from Kafka, run them with continuous batching, persist and stream results."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import signal
import socket
import sys

from workers.cli.engine_options import (
    add_engine_options,
    build_engine,
    build_warm_engine,
    input_limits,
    served_model_names,
    warm_up,
)
from workers.cli.lora_options import served_models
from workers.cli.options import add_log_options

log = logging.getLogger(__name__)

SAVE_INTERVAL_MS = 250.0  # serving/loop/progress.py's SAVE_INTERVAL_S (not imported: --help stays fast)
GC_YOUNG_THRESHOLD = 20_000  # allocations between young-generation collections (Python's default: 700)


DESCRIPTION = (
    "Consume jobs from the priority topics, generate with continuous batching, stream "
    "tokens, persist every job in PostgreSQL; running jobs' tokens are saved as they go, so another "
    "worker resumes a job this one lets go. SIGTERM/SIGINT: stop intake, save every running job's "
    "progress, leave the group (the others resume those jobs), commit, exit 0, all within the drain "
    "timeout; a second signal exits at once."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("worker", help="run an inference worker", description=DESCRIPTION)
    add_engine_options(p)
    p.add_argument("--worker-id", default=None, help="name in the jobs table (default: host-pid)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (default: INFERQ_METRICS_PORT, else none)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="jobs held here (waiting, or being admitted) before low partitions pause; normal pause at 1.5x, "
        "high at 2x, a hard cap (default: 256)",
    )
    p.add_argument(
        "--coalesce-ms",
        type=float,
        default=50.0,
        help="send token events of a job at most this often (default: 50)",
    )
    p.add_argument(
        "--tenant-topics",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tenant isolation: read each tenant's own topics, the tenant proven by the topic "
        "(default: INFERQ_TENANT_TOPICS; see `inferq tenant add`)",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine (model, scheduler, KV cache) in a process of its own, so the worker's Kafka, "
        "PostgreSQL and logging threads never hold the GIL its forward needs (default: on)",
    )
    p.add_argument(
        "--relay-nice",
        type=int,
        default=10,
        help="run the Kafka relay process (token events and results) this much nicer than the worker, so "
        "where cores are short the engine loop gets one first; 0: the same priority (default: 10)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM, the bound on handing running jobs over (progress saved, partitions released "
        "to the group, which resumes them) and exiting (default: 5)",
    )
    p.add_argument("--grace-s", dest="drain_timeout", type=float, help=argparse.SUPPRESS)  # earlier name
    p.add_argument(
        "--save-interval-ms",
        type=float,
        default=SAVE_INTERVAL_MS,
        metavar="MS",
        help="how often running jobs' new tokens are saved to PostgreSQL, for another worker to resume "
        "them from: a crash loses at most about this much generation per job; 0: never (default: "
        "%(default)g)",
    )
    add_log_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from workers import logs
    from workers.cli import progress_bars as progress
    from workers.settings import Settings

    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    logs.configure(args.log_level, args.log_format, worker_id)
    from workers.serving.loop.worker import Worker, WorkerOptions
    from workers.serving.metrics import WorkerMetrics

    settings = Settings.from_env()
    if args.tenant_topics is not None:
        settings = dataclasses.replace(settings, tenant_topics=args.tenant_topics)
    sys.setswitchinterval(settings.switch_interval_s)
    show_progress = args.log_format == "text" and progress.wanted()
    base_names = served_model_names(args, settings)
    try:  # the models jobs may name; a bad --lora-modules adapter stops the worker before it joins the group
        models = served_models(args, base_names)
        engine = _start_engine(args, settings, worker_id, show_progress)
    except (ValueError, EngineStartFailed) as exc:  # gpu.lora.LoraError is a ValueError
        print(f"inferq worker: {exc}", file=sys.stderr)
        return 2
    # the model, tokenizer and start-up objects live as long as the process: out of the collector's
    # generations, so a full collection no longer walks them (a pause of ~0.3 s every few thousand steps)
    gc.collect()
    gc.freeze()
    # A job's objects live until its row is written, so young collections find them alive; at Python's
    # default (a young collection every 700 allocations) the collector took 6-8% of a loaded worker's
    # wall time, all of it holding the GIL; every 20,000: 2-3%, and 12% less CPU per one-token job.
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    metrics = WorkerMetrics(base_names[0], args.max_loras)
    metrics_port = args.metrics_port if args.metrics_port is not None else settings.metrics_port
    if metrics_port:
        metrics.serve(metrics_port)
    options = WorkerOptions(
        worker_id=worker_id,
        max_waiting=args.max_waiting,
        coalesce_ms=args.coalesce_ms,
        relay_nice=max(0, args.relay_nice),
        drain_timeout_s=max(0.0, args.drain_timeout),
        save_interval_s=max(0.0, args.save_interval_ms) / 1000,
        limits=input_limits(args),
        models=models,
        served_model=base_names[0],  # announced to the fleet (/v1/models)
    )
    worker = Worker(settings, engine, options, metrics)

    def on_signal(signum: int, _frame: object) -> None:
        if worker.stopping:
            os._exit(128 + signum)  # second signal: leave now; uncommitted jobs are redelivered
        worker.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        worker.run()
    finally:
        engine.close()
    if worker.gave_up:
        log.critical("exiting with code 3: %s", worker.gave_up)
        return 3  # the orchestrator restarts or replaces the worker; its jobs are redone by the others
    return 0


class EngineStartFailed(RuntimeError):
    """The engine's process could not build its engine (the model, a --lora-modules adapter): why."""


def _start_engine(args: argparse.Namespace, settings, worker_id: str, show_progress: bool):
    """The engine, warmed up: in a process of its own (--engine-process) or in this one."""
    if not args.engine_process:
        engine = build_engine(args, settings.cache_dir, show_progress)
        warm_up(engine)
        return engine
    from functools import partial

    from gpu.engine_process import EngineProcess

    build = partial(build_warm_engine, args, settings.cache_dir, settings.failpoint, worker_id)
    try:
        return EngineProcess(build)
    except RuntimeError as exc:  # what the child raised while building, as text
        raise EngineStartFailed(str(exc)) from exc
