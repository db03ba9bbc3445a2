"""`python -m bench.engine.profile`: where the inferq engine's time goes on the bench workload.

Runs the engine once over the workload under the torch profiler (operators by self CPU time) and cProfile
(Python functions by cumulative time). Profiling slows the run; read shares, not absolute speed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

from gpu.model_source import DEFAULT_MODEL, MODEL_HELP


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.profile", description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", default="16:128", metavar="MIN:MAX")
    parser.add_argument("--output-len", default="8:256", metavar="MIN:MAX")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.engine.contenders.inferq import InferqContender
    from bench.workload import WorkloadSpec, make_workload, parse_range

    torch.set_num_threads(args.threads)
    spec = WorkloadSpec(args.requests, parse_range(args.prompt_len), parse_range(args.output_len), args.seed)
    contender = InferqContender(args.model, {})
    vocab_size = contender_vocab(args.model)
    requests = make_workload(spec, vocab_size)
    contender.warm_up(make_workload(WorkloadSpec(4, (16, 32), (4, 8), args.seed + 1), vocab_size))

    plain = contender.run(requests)
    print(f"unprofiled: {plain.wall_s:.2f} s, forward fraction {plain.extras['forward_fraction']:.3f}")

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        contender.run(requests)
    print(f"torch profiler run: {time.perf_counter() - start:.2f} s (engine construction included)\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))

    profiler = cProfile.Profile()
    profiler.enable()
    contender.run(requests)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())
    return 0


def contender_vocab(model: str | None) -> int:
    """The vocabulary of the model the engine will load (any name bench/engine/models.py understands)."""
    from bench.engine.models import load_hf_model

    return int(load_hf_model(model).config.vocab_size)


if __name__ == "__main__":
    sys.exit(main())
