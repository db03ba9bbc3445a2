"""Greedy sampling: the argmax of each logits row, with torch.argmax's answer on ties (the first maximum)
and on NaN (the first NaN, which torch counts as the maximum).

One program per row walks the vocabulary in tiles, each lane keeping its best value and first index; a
lane only takes a strictly greater value, so among equal maxima the earliest index survives.
Reference: torch.argmax (gpu.sampler.fast_argmax gives the same index).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _argmax_kernel(logits_ptr, out_ptr, stride_row, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    first_nan = tl.zeros([BLOCK], tl.int32) + vocab
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        x = tl.load(logits_ptr + row * stride_row + offs, mask=offs < vocab, other=float("-inf"))
        x = x.to(tl.float32)
        first_nan = tl.minimum(first_nan, tl.where(x != x, offs, vocab))
        better = x > best
        best = tl.where(better, x, best)
        best_index = tl.where(better, offs, best_index)
    top = tl.max(best, 0)
    # All -inf: no lane moved, every best_index is 0, as torch answers.
    index = tl.min(tl.where(best == top, best_index, vocab), 0)
    nan = tl.min(first_nan, 0)
    index = tl.where(nan < vocab, nan, index)
    tl.store(out_ptr + row, index.to(tl.int64))


def greedy_argmax(logits: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """[S, V] (any float dtype, rows may be strided) -> [S] int64."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and 0 < vocab < 2**31 - 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _argmax_kernel[(rows,)](logits, out, logits.stride(0), vocab, BLOCK=block, num_warps=4)
    return out
