"""`inferq worker`: consume jobs from Kafka, run them with continuous batching, persist and stream results."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model", default=None, help="local Hugging Face checkpoint dir (default: built-in small Llama)"
    )
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    g.add_argument("--max-num-seqs", type=int, default=64, help="running sequences per step at most")
    g.add_argument("--max-batched-tokens", type=int, default=512, help="tokens per step at most")
    g.add_argument("--kv-cache-mb", type=int, default=None, help="KV cache budget in MiB (default: engine's)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")


def build_engine(args: argparse.Namespace):
    from gpu.engine import Engine

    return Engine.from_options(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        kv_cache_bytes=args.kv_cache_mb * 2**20 if args.kv_cache_mb else None,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
    )


def warm_up(engine) -> None:
    """Run a prefill and a few decode steps before joining the group: the first steps of a process pay
    one-off costs (allocations, kernel selection) that would otherwise land on the first real job's TTFT."""
    from gpu.engine import EngineRequest
    from scheduler.types import SamplingParams

    prompt = tuple(engine.tokenizer.encode("warm-up " * 16))
    engine.generate([EngineRequest("inferq-warm-up", prompt, SamplingParams(max_tokens=4, ignore_eos=True))])


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "worker",
        help="run an inference worker",
        description="Consume jobs from the priority topics, generate with continuous batching, stream "
        "tokens, persist every job in PostgreSQL. SIGTERM/SIGINT: stop intake, finish in-flight jobs "
        "within the grace period, commit, exit 0; a second signal exits at once.",
    )
    add_engine_options(p)
    p.add_argument("--worker-id", default=None, help="name in the jobs table (default: host-pid)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--max-waiting", type=int, default=256, help="local queue size before pausing low/normal")
    p.add_argument(
        "--coalesce-ms", type=float, default=50.0, help="send token events of a job at most this often"
    )
    p.add_argument("--grace-s", type=float, default=30.0, help="time to finish in-flight jobs on shutdown")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    from workers.loop import Worker, WorkerOptions
    from workers.metrics import WorkerMetrics
    from workers.settings import Settings

    # The Kafka clients' I/O threads run Python; with the default 5 ms switch interval the engine loop can
    # wait that long for the GIL after every torch op. A short interval hands it back promptly.
    sys.setswitchinterval(float(os.environ.get("INFERQ_SWITCH_INTERVAL", "0.0005")))
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    engine = build_engine(args)
    warm_up(engine)
    metrics = WorkerMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    options = WorkerOptions(
        worker_id=worker_id, max_waiting=args.max_waiting, coalesce_ms=args.coalesce_ms, grace_s=args.grace_s
    )
    worker = Worker(Settings.from_env(), engine, options, metrics)

    def on_signal(signum: int, _frame: object) -> None:
        if worker.stopping:
            os._exit(128 + signum)  # second signal: leave now; uncommitted jobs are redelivered
        worker.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker.run()
    return 0
