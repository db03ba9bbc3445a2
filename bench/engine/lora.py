"""`inferq bench lora` / `python -m bench.engine.lora`: one workload on the base model, spread over 4 LoRA
adapters, and over 16 adapters with max_loras 4 (slots swapped as the scheduler drains and admits), at
each rank asked for; tok/s side by side in one run, in alternating repetitions, with the ratio to the base.

Adapters are written here as PEFT saves them (every q, k, v, o, gate, up and down projection adapted,
random weights) and loaded into the host cache before the timed runs; jobs name them round robin. One
engine serves every run with the defaults users get (max_loras 4, max_lora_rank 16); its base-only steps
run no LoRA code at all (no live request holds an adapter), so `base` is also what LoRA off costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu.model_source import DEFAULT_MODEL, MODEL_HELP

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"{MODEL_HELP} (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=256, help="16 per adapter in the 16-adapter run")
    parser.add_argument("--prompt-len", default="16:128", metavar="MIN:MAX", help="prompt tokens, uniform")
    parser.add_argument("--output-len", default="8:64", metavar="MIN:MAX", help="generated tokens, uniform")
    parser.add_argument("--ranks", default="8,16", help="adapter ranks, comma-separated")
    parser.add_argument("--reps", type=int, default=2, help="alternating repetitions of each run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (and OMP_NUM_THREADS)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="default: bench/results/lora-*.json")


def write_adapter(directory: Path, model: Any, rank: int, seed: int) -> Path:
    """A PEFT-format adapter of `model` (random A, B scaled so outputs change but stay sane)."""
    import torch
    from safetensors.torch import save_file

    from gpu.lora.adapter import model_targets

    targets = model_targets(model)
    tensors = {}
    g = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers"
    for layer in range(targets.num_layers):
        for parts in targets.parts.values():
            for part in parts:
                name = f"{prefix}.{layer}.{part.module}"
                a = torch.randn(rank, part.in_features, generator=g) / part.in_features**0.5
                tensors[f"{name}.lora_A.weight"] = a
                tensors[f"{name}.lora_B.weight"] = torch.randn(part.out_features, rank, generator=g) * 0.02
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    modules = sorted({p.module.rsplit(".", 1)[-1] for parts in targets.parts.values() for p in parts})
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=modules, bias="none")
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def _timed(engine: Any, requests: list[Any]) -> dict[str, float]:
    before = engine.stats()
    for request in requests:
        engine.add_request(request)
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - start
    after = engine.stats()
    steps = after.steps - before.steps
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "mean_batch": (after.mean_batch_size * after.steps - before.mean_batch_size * before.steps) / steps,
    }


def run(args: argparse.Namespace) -> int:
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import dataclasses

    import torch

    torch.set_num_threads(args.threads)
    from bench.machine import machine_info
    from bench.report import default_json_path, format_table, write_json
    from bench.workload import WorkloadSpec, make_workload, parse_range
    from gpu.engine import Engine, EngineRequest
    from gpu.engine_types import LoraRequest
    from scheduler.types import SamplingParams

    ranks = [int(r) for r in args.ranks.split(",")]
    spec = WorkloadSpec(args.requests, parse_range(args.prompt_len), parse_range(args.output_len), args.seed)
    options = dict(max_num_seqs=args.max_num_seqs, max_loras=4, max_lora_rank=max(16, *ranks))
    engine = Engine.from_options(args.model, device=args.device, **options)
    model = engine.model
    workload = make_workload(spec, model.config.vocab_size)
    base = [
        EngineRequest(r.request_id, r.prompt_token_ids, SamplingParams(r.max_new_tokens, ignore_eos=True))
        for r in workload
    ]  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="inferq-lora-bench-"))
    runs: dict[str, list[Any]] = {"base": base}
    for rank in ranks:
        names = [f"r{rank}-{i}" for i in range(16)]
        adapters = [
            LoraRequest(name, str(write_adapter(folder / name, model, rank, 99 * rank + i)))
            for i, name in enumerate(names)
        ]
        for count in (4, 16):
            runs[f"{count} adapters, rank {rank}"] = [
                dataclasses.replace(r, lora=adapters[i % count]) for i, r in enumerate(base)
            ]
    # warm-up, untimed: the base and the LoRA paths once each (thread tuning, first allocations)
    warm = base[:4] + runs[f"4 adapters, rank {ranks[0]}"][4:8]
    _timed(engine, [dataclasses.replace(r, request_id=f"warm-{r.request_id}") for r in warm])
    results: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for rep in range(args.reps):
        for name, requests in runs.items():
            for request in requests:
                if request.lora is not None:
                    engine.load_lora(request.lora)  # untimed: the host cache holds them
            prefix = f"{rep}-{name}-"
            timed = [dataclasses.replace(r, request_id=prefix + r.request_id) for r in requests]
            results[name].append(_timed(engine, timed))
            print(f"  rep {rep} {name}: {results[name][-1]['tok_s']:.1f} tok/s", flush=True)
    summary = {name: statistics.median(r["tok_s"] for r in reps) for name, reps in results.items()}
    base_tok_s = summary["base"]
    rows = [
        [name, summary[name], summary[name] / base_tok_s, statistics.median(r["mean_batch"] for r in reps)]
        for name, reps in results.items()
    ]
    table = format_table(["run", "tok/s", "vs base", "mean batch"], rows, digits=2)
    print(f"\n{args.model} on {args.device}, {args.requests} requests, {args.reps} reps (median)\n{table}")
    payload = {
        "kind": "lora",
        "machine": machine_info(),
        "model": args.model,
        "device": args.device,
        "workload": spec.to_dict(),
        "engine": options,
        "results": results,
        "tok_s": summary,
        "ratio_to_base": {name: value / base_tok_s for name, value in summary.items()},
    }
    print(f"results: {write_json(args.json or default_json_path('lora'), payload)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.lora", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
