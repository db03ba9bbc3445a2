"""`inferq bench e2e`: jobs through real Kafka and PostgreSQL with one worker, against the engine alone.

One run, one worker subprocess on a private topic prefix:
(a) saturation: the engine benchmark's workload submitted at once → useful tokens/s from the first submit to
    the last final token event, vs the engine alone in this process on the same prompts (alternating reps);
(b) Poisson arrivals at fractions of the saturated job rate → TTFT, ITL, e2e p50/p99 as the client sees them;
(c) priority: high jobs' TTFT p99 behind a saturating low-priority backlog vs on an idle worker.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from pathlib import Path

from bench.report import RESULTS_DIR
from gpu.model_source import DEFAULT_MODEL, MODEL_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "e2e.json", help="result file")
    parser.add_argument("--requests", type=int, default=64, help="saturation: jobs per repetition")
    parser.add_argument("--prompt-len", default="16:128", metavar="MIN:MAX", help="prompt tokens, uniform")
    parser.add_argument("--output-len", default="8:256", metavar="MIN:MAX", help="max_tokens, uniform")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--reps", type=int, default=2, help="alternating engine/e2e repetitions")
    parser.add_argument(
        "--rates", default="0.25,0.5,0.8", help="Poisson rates as fractions of the saturated job rate"
    )
    parser.add_argument("--poisson-jobs", type=int, default=30, help="jobs per Poisson rate")
    parser.add_argument("--backlog", type=int, default=200, help="priority: low-priority backlog jobs")
    parser.add_argument("--backlog-output", type=int, default=256, help="priority: backlog jobs' max_tokens")
    parser.add_argument("--high-jobs", type=int, default=10, help="priority: high-priority jobs per case")
    parser.add_argument("--high-gap-s", type=float, default=0.3, help="priority: seconds between high jobs")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"{MODEL_HELP} (default: %(default)s)")
    parser.add_argument(
        "--threads",
        default="1,2",
        help="torch threads of the engine and the worker; a list runs the saturation at each count side by "
        "side (the first count's numbers, and its Poisson and priority phases, are the run's results)",
    )
    parser.add_argument("--worker-args", default="", help="extra `inferq worker` options ('--coalesce-ms 5')")
    parser.add_argument(
        "--phases", default="saturation,poisson,priority", help="a subset, for quick looks at one part"
    )
    parser.add_argument(
        "--job-rate",
        type=float,
        default=None,
        help="saturated jobs/s for the Poisson rates (default: measured)",
    )
    parser.add_argument("--keep-topics", action="store_true", help="keep the run's private topics afterwards")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="longest wait for a batch of jobs")


def run(args: argparse.Namespace) -> int:
    counts = [int(t) for t in str(args.threads).split(",") if t.strip()]
    os.environ["OMP_NUM_THREADS"] = str(max(counts))  # before torch is imported in this process
    signal.signal(signal.SIGTERM, _exit_cleanly)  # unwind, so the worker subprocess is stopped too
    from bench.e2e.run import run_e2e_bench
    from bench.report import write_json

    payload, table = run_e2e_bench(args, shlex.split(args.worker_args))
    print(table)
    path = write_json(args.json, payload)
    print(f"\nresults: {path}")
    from bench.e2e.report import figure
    from bench.plots import png_path, write_or_explain

    print(write_or_explain(figure, payload, png_path(path)))
    return 0


def _exit_cleanly(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
