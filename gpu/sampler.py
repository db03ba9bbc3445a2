"""Token sampling: greedy, temperature, top-k, top-p; per-request seeds independent of batch mates."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from scheduler.types import SamplingParams

_ARGMAX_BLOCK = 128
_MASK64 = (1 << 64) - 1


def fast_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of [S, V], the same index as torch.argmax (first maximum on ties) but faster on CPU.

    The maximum per block of the vocabulary, then argmax inside the first block that holds the row maximum.
    """
    rows, vocab = logits.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    pad = -vocab % _ARGMAX_BLOCK
    if pad:
        logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    blocks = logits.view(rows, -1, _ARGMAX_BLOCK)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)  # first block holding the maximum
    inner = blocks[torch.arange(rows, device=logits.device), best_block].argmax(dim=-1)
    return best_block * _ARGMAX_BLOCK + inner


def step_seed(seed: int, num_generated: int) -> int:
    """A well-mixed 63-bit seed for one token of one request (splitmix64 of seed and position)."""
    z = (seed * 0x9E3779B97F4A7C15 + num_generated + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p on one row [V]; removed tokens get -inf."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample_row(logits: torch.Tensor, params: SamplingParams, seed: int, num_generated: int) -> int:
    probs = torch.softmax(filter_logits(logits.float(), params), dim=-1)
    generator = torch.Generator(device=logits.device).manual_seed(step_seed(seed, num_generated))
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], num_generated: Sequence[int]
) -> list[int]:
    """One token per row of logits [S, V]; row i uses params[i], seeds[i] and its output position."""
    tokens = fast_argmax(logits).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = sample_row(logits[i], p, seeds[i], num_generated[i])
    return tokens
