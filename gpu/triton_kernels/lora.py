"""LoRA shrink and expand over stacked adapter slots, rows grouped by slot (Punica's SGMV idea).

A step's adapter rows are grouped by slot in one int64 vector `meta` (gpu/lora/slots.py): [start by slot,
count by slot, rows]. The grid is (row tiles of the largest possible group, [output tiles,] slots): each
program takes one tile of one slot's rows, gathers them by index and multiplies them by that slot's matrix
with tl.dot; tiles past its slot's count return at once. Nothing depends on the host's view of the step
but the grid's size (the most rows a step may name), so a decode graph captures the kernels once and a
replay serves whatever adapters its rows use; base rows are in no group and are never read.

- shrink: y[i] = x[rows[i]] @ A[slot].T, into a float32 [max_rows, R] buffer by grouped position;
- expand: out[rows[i]] += y[i] @ B[slot].T, in place (y rounded to B's dtype for the dot, as vLLM's
  expand; the sum with out in float32, rounded once).

Their references are gpu.lora.slots.shrink_reference / expand_reference (tests/gpu/test_lora_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.triton_kernels import next_pow2


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, y_ptr, meta_ptr,
    stride_x, stride_a_slot, stride_a_row, stride_y,
    K, R,
    SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    slot = tl.program_id(1)
    count = tl.load(meta_ptr + SLOTS + slot)
    if tile * BLOCK_M >= count:
        return
    start = tl.load(meta_ptr + slot).to(tl.int64)  # meta is int64; said so for the offset check
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(meta_ptr + 2 * SLOTS + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * stride_a_slot
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        a_t = tl.load(  # [BLOCK_K, BLOCK_R]: A's rows as columns
            a_base + offs_r[None, :] * stride_a_row + offs_k[:, None],
            mask=mask_r[None, :] & mask_k[:, None],
            other=0.0,
        )
        acc += tl.dot(x, a_t, input_precision=PRECISION)
    tl.store(
        y_ptr + (start + offs_m)[:, None] * stride_y + offs_r[None, :],
        acc,
        mask=mask_m[:, None] & mask_r[None, :],
    )


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, out_ptr, meta_ptr,
    stride_y, stride_b_slot, stride_b_row, stride_out,
    N, R,
    SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    slot = tl.program_id(2)
    count = tl.load(meta_ptr + SLOTS + slot)
    if tile * BLOCK_M >= count:
        return
    start = tl.load(meta_ptr + slot).to(tl.int64)  # meta is int64; said so for the offset check
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(meta_ptr + 2 * SLOTS + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    b_base = b_ptr + slot.to(tl.int64) * stride_b_slot
    b_t = tl.load(  # [BLOCK_R, BLOCK_N]: B's rows as columns
        b_base + offs_n[None, :] * stride_b_row + offs_r[:, None],
        mask=mask_r[:, None] & mask_n[None, :],
        other=0.0,
    )
    y = tl.load(
        y_ptr + (start + offs_m)[:, None] * stride_y + offs_r[None, :],
        mask=mask_m[:, None] & mask_r[None, :],
        other=0.0,
    )
    delta = tl.dot(y.to(b_t.dtype), b_t, input_precision=PRECISION)
    out_ptrs = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    current = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (current + delta).to(out_ptr.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 stays fp32, as the reference


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, meta: torch.Tensor, max_rows: int, block_m: int = 16, block_k: int = 64
) -> torch.Tensor:
    """x [T, K], a [slots, R, K] -> y [max_rows, R] float32 (rows by grouped position; only those of a
    group are written)."""
    slots, width, k = a.shape
    assert x.shape[1] == k and x.stride(1) == 1 and a.stride(2) == 1 and x.dtype == a.dtype
    y = torch.empty((max_rows, width), dtype=torch.float32, device=x.device)
    if max_rows:
        _shrink_kernel[(triton.cdiv(max_rows, block_m), slots)](
            x, a, y, meta, x.stride(0), a.stride(0), a.stride(1), y.stride(0), k, width,
            SLOTS=slots, BLOCK_M=block_m, BLOCK_R=max(16, next_pow2(width)), BLOCK_K=block_k,
            PRECISION=_precision(x.dtype), num_warps=4,
        )  # fmt: skip
    return y


def lora_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    meta: torch.Tensor,
    max_rows: int,
    block_m: int = 16,
    block_n: int = 64,
) -> None:
    """out [T, N] += y [max_rows, R] @ b[slot].T at each grouped row (b [slots, N, R])."""
    slots, n, width = b.shape
    assert out.shape[1] == n and out.stride(1) == 1 and b.stride(2) == 1 and y.shape[1] == width
    if max_rows:
        _expand_kernel[(triton.cdiv(max_rows, block_m), triton.cdiv(n, block_n), slots)](
            y, b, out, meta, y.stride(0), b.stride(0), b.stride(1), out.stride(0), n, width,
            SLOTS=slots, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, next_pow2(width)),
            PRECISION=_precision(b.dtype), num_warps=4,
        )  # fmt: skip
