"""`python -m bench.engine` / `inferq bench engine`: static batching vs HF continuous batching vs
inferq vs the compute floor, on one seeded workload, in alternating repetitions within one run."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gpu.model_source import DEFAULT_MODEL, MODEL_HELP

ALL = ("static", "hf_cb", "inferq", "limit")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", type=Path, default=None, help="result file (default: bench/results/engine-*.json)"
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", default="16:128", metavar="MIN:MAX", help="prompt tokens, uniform")
    parser.add_argument("--output-len", default="8:256", metavar="MIN:MAX", help="generated tokens, uniform")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"{MODEL_HELP} (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=3, help="alternating repetitions of each contender")
    parser.add_argument("--only", default=",".join(ALL), help=f"comma-separated subset of {','.join(ALL)}")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (and OMP_NUM_THREADS)")
    parser.add_argument("--group-size", type=int, default=16, help="static: requests per generate() call")
    parser.add_argument(
        "--hf-max-batch-tokens", type=int, default=256, help="hf_cb: best seen on this machine"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="inferq: running sequences at most")
    parser.add_argument(
        "--max-batched-tokens", type=int, default=1024, help="inferq: tokens per step at most"
    )
    parser.add_argument(
        "--no-step-time", action="store_true", help="skip inferq's step time at batch 16/32/64"
    )
    parser.add_argument(
        "--async-scheduling",
        choices=["on", "off", "auto"],
        default="auto",
        help="inferq: schedule the next step while this one runs (auto: the engine's default)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (every contender runs there)")
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="inferq's KV cache size (default: the engine's own sizing)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: float32 on cpu, bfloat16 on cuda",
    )


def run(args: argparse.Namespace) -> int:
    only = tuple(name.strip() for name in args.only.split(",") if name.strip())
    unknown = set(only) - set(ALL)
    if unknown or not only:
        print(f"--only: unknown contender(s) {sorted(unknown)}; choose from {','.join(ALL)}", file=sys.stderr)
        return 2
    # Before torch is imported anywhere in this process, or it has no effect.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from bench.engine.runner import run_engine_bench

    payload, table = run_engine_bench(args, only)
    print(table)
    from bench.report import default_json_path, write_json

    path = write_json(args.json or default_json_path("engine"), payload)
    print(f"\nresults: {path}")
    from bench.plots import engine_figure, png_path, write_or_explain

    print(write_or_explain(engine_figure, payload, png_path(path)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
