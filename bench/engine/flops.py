"""The compute floor: forward FLOPs of a workload, and the machine's fp32 matmul FLOP/s."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from bench.workload import BenchRequest

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs to know about a decoder-only model."""

    body_linear_params: int  # weights of every matmul in the decoder layers (no embeddings, no lm_head)
    num_layers: int
    attn_dim: int  # query heads x head dim: the width of QK^T and AV per token
    lm_head_params: int  # vocab x hidden

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def shape_of(model: torch.nn.Module) -> ModelShape:
    """Read the shape off an HF causal LM: every nn.Linear except the output projection counts as body."""
    import torch

    lm_head = model.get_output_embeddings()
    body = sum(
        module.weight.numel()
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and module is not lm_head
    )
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelShape(
        body_linear_params=body,
        num_layers=config.num_hidden_layers,
        attn_dim=config.num_attention_heads * head_dim,
        lm_head_params=lm_head.weight.numel(),
    )


def request_flops(shape: ModelShape, prompt_len: int, new_tokens: int) -> int:
    """Forward FLOPs to produce `new_tokens` tokens after a prompt, with a KV cache and no padding.

    The forward sees the prompt and every generated token but the last (P + N - 1 positions); the
    position with index i attends over i + 1 keys. The lm_head runs only on the N positions that sample.
    """
    positions = prompt_len + new_tokens - 1
    matmul = 2 * shape.body_linear_params * positions
    keys_total = positions * (positions + 1) // 2
    attention = 4 * shape.attn_dim * shape.num_layers * keys_total  # QK^T and AV, 2 FLOPs per multiply-add
    lm_head = 2 * shape.lm_head_params * new_tokens
    return matmul + attention + lm_head


def workload_flops(shape: ModelShape, requests: tuple[BenchRequest, ...]) -> int:
    return sum(request_flops(shape, len(r.prompt_token_ids), r.max_new_tokens) for r in requests)


def matmul_flops_per_s(
    device: str = "cpu", dtype: str = "float32", size: int | None = None, repeats: int = 3
) -> float:
    """Best FLOP/s of a square matrix product: what the machine's BLAS (or the GPU) reaches at best."""
    import torch

    size = size or (2048 if device == "cpu" else 8192)
    generator = torch.Generator().manual_seed(0)
    kind = getattr(torch, dtype)
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=kind)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=kind)
    out = torch.empty(size, size, device=device, dtype=kind)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    torch.mm(a, b, out=out)  # warm-up: thread pool, page faults, kernel choice
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best
