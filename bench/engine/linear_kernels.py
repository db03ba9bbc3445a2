"""`python -m bench.engine.linear_kernels`: the engine's linear kernels side by side at a model's weight
shapes.

For every distinct weight shape of the model (fused qkv, o, fused gate/up, down, lm_head) and a range of
row counts, times `F.linear` ("plain"), oneDNN's prepacked kernel ("packed") and the panel kernel
(gpu/cpu/native/linear.c) in alternation, and prints each one's GFLOP/s, the panel kernel's speed-up over the
best of the other two, and which kernel the engine's start-up measurement would choose.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bench.report import default_json_path, format_table, write_json
from gpu.model_source import DEFAULT_MODEL, MODEL_HELP

ROWS = (1, 8, 16, 32, 64, 256, 1024)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.linear_kernels", description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts")
    parser.add_argument("--reps", type=int, default=15, help="timed calls per kernel and size (median)")
    parser.add_argument("--json", type=Path, default=None, help="result file (default: bench/results/)")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported

    import torch

    from bench.machine import machine_info
    from gpu.cpu import autotune
    from gpu.cpu.linear import Linear
    from gpu.forward import LlamaForward
    from gpu.model import load_model
    from gpu.runner import linears_of

    torch.set_num_threads(args.threads)
    forward = LlamaForward(load_model(args.model, device="cpu", dtype="float32"), max_positions=16)
    shapes = sorted({tuple(m.weight.shape) for m in [*linears_of(forward), forward.lm_head]})
    rows_list = [int(r) for r in args.rows.split(",") if r.strip()]
    generator = torch.Generator().manual_seed(0)
    results, table = [], []
    for out_features, in_features in shapes:
        linear = Linear(torch.randn(out_features, in_features, generator=generator), None)
        chosen = autotune.linear_choice(
            out_features, in_features, torch.float32, max(rows_list), args.threads
        )
        for rows in rows_list:
            x = torch.randn(rows, in_features, generator=generator)
            runs = {k: lambda k=k, x=x, m=linear: m.run(k, x) for k in linear.kernels}
            seconds = autotune.race(runs, args.reps)
            flops = 2 * out_features * in_features * rows
            others = [s for k, s in seconds.items() if k != "panel"]
            speedup = min(others) / seconds["panel"] if "panel" in seconds and others else None
            row = {
                "shape": [out_features, in_features],
                "rows": rows,
                "seconds": seconds,
                "gflop_s": {k: flops / s / 1e9 for k, s in seconds.items()},
                "panel_speedup": speedup,
                "chosen": _kernel_for(chosen, rows),
            }
            results.append(row)
            gf = row["gflop_s"]
            table.append([f"{out_features}x{in_features}", rows, gf.get("plain"), gf.get("packed"),
                          gf.get("panel"), speedup, row["chosen"]])  # fmt: skip
    print(f"GFLOP/s per kernel ({args.model}, {args.threads} threads; median of {args.reps} calls each)\n")
    headers = ["weight", "rows", "plain", "packed", "panel", "panel / best other", "chosen"]
    print(format_table(headers, table, digits=2))
    payload = {"model": args.model, "threads": args.threads, "machine": machine_info(), "results": results}
    path = write_json(args.json or default_json_path("linear-kernels"), payload)
    print(f"\nresults: {path}")
    return 0


def _kernel_for(choice, rows: int) -> str:
    return next(kernel for below, kernel in choice if rows < below)


if __name__ == "__main__":
    raise SystemExit(main())
