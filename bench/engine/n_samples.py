"""n samples of one prompt: one request with n, against n separate requests of the same prompt.

Counts what the fork saves: prompt tokens run through the model, the peak of KV blocks in use, and the
wall time of the whole run. Prints a table and writes JSON.

    python -m bench.engine.n_samples [--model tiny] [--device cpu] [--n 4] [--prompt-len 512] [--json FILE]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from bench.machine import machine_info
from bench.report import default_json_path, format_table, write_json
from gpu.engine import Engine, EngineRequest
from scheduler.types import SamplingParams


def run(engine: Engine, requests: list[EngineRequest]) -> dict[str, Any]:
    before = engine.stats()
    for request in requests:
        engine.add_request(request)
    peak, tokens = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        peak = max(peak, engine.stats().kv_blocks_used)
    seconds = time.perf_counter() - start
    after = engine.stats()
    return {
        "prompt_tokens_computed": after.prompt_tokens_computed - before.prompt_tokens_computed,
        "peak_kv_blocks": peak,
        "generated_tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine.n_samples", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=None, help="a model spec (default: the tiny built-in model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--json", type=Path, default=None, help="result file (default: bench/results/n-samples-*.json)"
    )
    args = parser.parse_args(argv)
    rng = random.Random(7)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=11, ignore_eos=True)
    results: dict[str, dict[str, Any]] = {}
    for name, caching in (("n separate, no prefix cache", False), ("n separate, prefix cache", True)):
        engine = Engine.from_options(args.model, device=args.device, enable_prefix_caching=caching)
        vocab = engine.model.config.vocab_size
        prompt = tuple(rng.randrange(3, vocab) for _ in range(args.prompt_len))
        run(engine, [EngineRequest("warm-up", prompt[:8], SamplingParams(max_tokens=2))])
        separate = [EngineRequest(f"s{i}", prompt, params) for i in range(args.n)]
        results[name] = run(engine, separate)
        if not caching:  # the fork shares without the prefix cache
            results[f"one request, n={args.n}"] = run(engine, [EngineRequest("g", prompt, params, n=args.n)])
    keys = ("prompt_tokens_computed", "peak_kv_blocks", "tokens_per_s", "seconds")
    headers = ["", "prompt tokens", "peak KV blocks", "tokens/s", "seconds"]
    print(format_table(headers, [[name, *(r[k] for k in keys)] for name, r in results.items()]))
    options = {k: str(v) for k, v in vars(args).items()}
    path = write_json(args.json or default_json_path("n-samples"), {"options": options, "results": results,
                                                                    "machine": machine_info()})  # fmt: skip
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
