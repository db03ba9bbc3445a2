"""KV blocks a model windowed on every layer holds: the same random-weight Mistral with and without a
sliding window, the same long sequences, the peak of KV blocks in use (blocks behind the window are given
back as sequences advance). Prints a table and writes JSON.

    python -m bench.engine.windowed_kv [--window 64] [--sequences 8] [--prompt-len 900] [--max-tokens 200]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench.machine import machine_info
from bench.report import default_json_path, format_table, write_json
from gpu.engine import Engine, EngineConfig, EngineRequest
from gpu.model import LoadedModel
from gpu.tokenizer import ByteTokenizer
from scheduler.types import SamplingParams

SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def mistral(window: int | None, seed: int = 0) -> LoadedModel:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(sliding_window=window, bos_token_id=1, eos_token_id=2, pad_token_id=0, **SHAPE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MistralForCausalLM(config).eval()
    return LoadedModel(model, config, ByteTokenizer(config.vocab_size), torch.device("cpu"), torch.float32)


def run(model: LoadedModel, prompts: list[tuple[int, ...]], max_tokens: int) -> dict[str, Any]:
    engine = Engine(
        model, EngineConfig(num_blocks=2048, max_num_batched_tokens=512, max_num_seqs=len(prompts))
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    peak, tokens = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        peak = max(peak, engine.stats().kv_blocks_used)
    seconds = time.perf_counter() - start
    return {
        "peak_kv_blocks": peak,
        "kv_window": engine.scheduler.kv.window,
        "generated_tokens": tokens,
        "seconds": round(seconds, 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine.windowed_kv", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=900)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument(
        "--json", type=Path, default=None, help="result file (default: bench/results/windowed-kv-*.json)"
    )
    args = parser.parse_args(argv)
    rng = random.Random(3)
    prompts = [tuple(rng.randrange(3, 512) for _ in range(args.prompt_len)) for _ in range(args.sequences)]
    results = {
        "no window": run(mistral(None), prompts, args.max_tokens),
        f"window {args.window}": run(mistral(args.window), prompts, args.max_tokens),
    }
    rows = [[name, r["kv_window"] or "-", r["peak_kv_blocks"], r["generated_tokens"], r["seconds"]]
            for name, r in results.items()]  # fmt: skip
    print(f"{args.sequences} sequences of {args.prompt_len} + {args.max_tokens} tokens, blocks of 16:")
    print(format_table(["model", "kv window", "peak KV blocks", "tokens", "seconds"], rows))
    path = args.json or default_json_path("windowed-kv")
    write_json(
        path, {"machine": machine_info(), "params": vars(args) | {"json": str(path)}, "results": results}
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
