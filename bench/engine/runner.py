"""Running `bench engine`: build the contenders, warm them up, then alternate repetitions and summarise."""

from __future__ import annotations

import argparse
import sys
import time

from bench.engine.contenders import Contender
from bench.workload import WorkloadSpec, make_workload, parse_range


def run_engine_bench(args: argparse.Namespace, only: tuple[str, ...]) -> tuple[dict[str, object], str]:
    import torch

    from bench.engine.flops import matmul_flops_per_s, shape_of, workload_flops
    from bench.engine.models import load_hf_model
    from bench.engine.summary import EngineBenchRaw, render, summarize
    from bench.machine import machine_info

    torch.set_num_threads(args.threads)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    spec = WorkloadSpec(args.requests, parse_range(args.prompt_len), parse_range(args.output_len), args.seed)
    reference = load_hf_model(args.model)
    vocab_size = reference.config.vocab_size
    shape = shape_of(reference)
    # Long workloads may run past the model's trained context (RoPE extends; HF's contenders do too).
    longest = spec.prompt_len[1] + spec.output_len[1]
    args.inferq_max_model_len = max(longest, reference.config.max_position_embeddings)
    del reference
    requests = make_workload(spec, vocab_size)
    warm_up = make_workload(WorkloadSpec(4, (16, 32), (4, 8), args.seed + 1), vocab_size)

    contenders = _build(args, only)
    for contender in contenders:
        _progress(f"warm-up {contender.name}")
        contender.warm_up(warm_up)

    runs: dict[str, list] = {contender.name: [] for contender in contenders}
    flops_per_s: list[float] = []
    useful = sum(r.max_new_tokens for r in requests)
    for rep in range(args.reps):
        for contender in contenders:
            result = contender.run(requests)
            runs[contender.name].append(result)
            tok_s = useful / result.wall_s
            _progress(
                f"rep {rep + 1}/{args.reps} {contender.name}: {result.wall_s:.2f} s, {tok_s:,.0f} tok/s"
            )
        if "limit" in only:
            flops_per_s.append(matmul_flops_per_s(args.device, args.dtype))
            _progress(
                f"rep {rep + 1}/{args.reps} limit: {flops_per_s[-1] / 1e9:,.1f} GFLOP/s {args.dtype} matmul"
            )

    step_times = {}
    if "inferq" in only and not args.no_step_time:
        from bench.engine.step_time import measure_step_times

        _progress("inferq step time at batch 16/32/64")
        step_times = measure_step_times(args.model, _inferq_options(args), vocab_size)

    gaps = _divergence_gaps(args.model, requests, runs)
    raw = EngineBenchRaw(
        spec=spec,
        requests=requests,
        shape=shape,
        workload_flops=workload_flops(shape, requests),
        runs=runs,
        flops_per_s=flops_per_s,
        step_times=step_times,
        logit_gaps=gaps,
    )
    payload = summarize(raw, machine_info(), args.model)
    payload["options"] = {
        k: (str(v) if v is not None else None) for k, v in vars(args).items() if k != "func"
    }
    return payload, render(payload)


def _divergence_gaps(model: str | None, requests, runs: dict[str, list]) -> dict[str, dict[str, float]]:
    """Per contender, the reference's logit gap where its first repetition's greedy tokens left static's."""
    from bench.engine.near_ties import logit_gaps
    from bench.workload import compare_tokens

    reference = runs.get("static")
    if not reference:
        return {}
    gaps = {}
    for name, results in runs.items():
        if name != "static" and results:
            found = compare_tokens(requests, reference[0].tokens, results[0].tokens)["first_divergence"]
            if found:
                _progress(f"{name}: {len(found)} requests left static's tokens; measuring the logit gaps")
            gaps[name] = logit_gaps(model, requests, reference[0].tokens, results[0].tokens, found)
    return gaps


def _build(args: argparse.Namespace, only: tuple[str, ...]) -> list[Contender]:
    contenders: list[Contender] = []
    if "static" in only:
        from bench.engine.contenders.static import StaticContender

        contenders.append(StaticContender(args.model, args.group_size, args.device, args.dtype))
    if "hf_cb" in only:
        from bench.engine.contenders.hf_cb import HfContinuousBatchingContender

        contenders.append(
            HfContinuousBatchingContender(
                args.model, max_batch_tokens=args.hf_max_batch_tokens, device=args.device, dtype=args.dtype
            )
        )
    if "inferq" in only:
        from bench.engine.contenders.inferq import InferqContender

        contenders.append(InferqContender(args.model, _inferq_options(args)))
    return contenders


def _inferq_options(args: argparse.Namespace) -> dict[str, object]:
    return {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_batched_tokens,
        "max_model_len": args.inferq_max_model_len,
        "device": args.device,
        "dtype": args.dtype,
        **({"kv_cache_memory": int(args.kv_cache_gib * 2**30)} if args.kv_cache_gib else {}),
        # getattr: other benches build these options without the flag
        "async_scheduling": {"on": True, "off": False}.get(getattr(args, "async_scheduling", "auto")),
    }


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
