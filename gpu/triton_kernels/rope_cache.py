"""RoPE of a step's q and k rows, in place, and the K/V cache write at its slots: one program per token.

Same contract as the C kernel gpu.cpu.rope_write.RopeCacheWrite (and so a drop-in for LlamaForward.rope_write
on CUDA); the reference is gpu.forward.rotate (rotate-half RoPE) followed by KVCache.write. Products and
sums are float32 with one rounding to the model's dtype, where torch rounds after each operator: half
precision results may differ from it by one unit in the last place (float32 ones only by fma contraction).
A negative slot skips that token's cache write (the repo never makes one; padding rows use a trash block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.kv_cache import KVCache
from gpu.triton_kernels import next_pow2


@triton.jit
def _rope_cache_kernel(
    qk_ptr,
    v_ptr,
    positions_ptr,
    slots_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_qkt,
    stride_qkh,
    stride_vt,
    stride_vh,
    stride_table,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    slot = tl.load(slots_ptr + token)

    # q heads then k heads, each row split in halves: rotate_half(x) = (-x2, x1)
    rows = tl.arange(0, BLOCK_R)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (rows < NUM_HEADS + NUM_KV_HEADS)[:, None] & (offs < HALF)[None, :]
    first = qk_ptr + token * stride_qkt + rows[:, None] * stride_qkh + offs[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    table = position * stride_table + offs[None, :]
    half_mask = (offs < HALF)[None, :]
    cos1 = tl.load(cos_ptr + table, mask=half_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + HALF, mask=half_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table, mask=half_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + HALF, mask=half_mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos1 - x2 * sin1).to(qk_ptr.dtype.element_ty)
    out2 = (x2 * cos2 + x1 * sin2).to(qk_ptr.dtype.element_ty)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)

    # the k rows (NUM_HEADS..) into the cache: head h at h * stride_cache_head + slot * HEAD_DIM, in int64
    # (a cache filling most of a GPU has a per-head stride near 2^31: heads >= 1 would wrap in int32)
    kv_rows = tl.where(rows >= NUM_HEADS, rows - NUM_HEADS, 0).to(tl.int64)
    cached = (slot + tl.zeros([BLOCK_R], tl.int64)) >= 0  # as a vector: the interpreter wants mask tensors
    k_mask = mask & ((rows >= NUM_HEADS) & cached)[:, None]
    k_dest = k_cache_ptr + kv_rows[:, None] * stride_cache_head + slot * HEAD_DIM + offs[None, :]
    tl.store(k_dest, out1, mask=k_mask)
    tl.store(k_dest + HALF, out2, mask=k_mask)

    kv = tl.arange(0, BLOCK_KV).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    v_mask = (kv < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    values = tl.load(v_ptr + token * stride_vt + kv[:, None] * stride_vh + dims[None, :], mask=v_mask)
    v_dest = v_cache_ptr + kv[:, None] * stride_cache_head + slot * HEAD_DIM + dims[None, :]
    tl.store(v_dest, values, mask=v_mask & ((slot + tl.zeros([BLOCK_KV], tl.int64)) >= 0)[:, None])


def rope_cache_write(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Rotate qk [T, heads + kv_heads, D] in place with the cos/sin tables [max_positions, D] at
    `positions` [T], then store its k rows and v [T, kv_heads, D] at flat `slots` [T] (block * block_size +
    offset) of one layer's k_cache/v_cache [kv_heads, num_blocks, block_size, D].

    Positions and slots are not bounds-checked (as the C kernel): the caller keeps them in range."""
    tokens, rows, dim = qk.shape
    kv_heads = v.shape[1]
    assert dim % 2 == 0 and qk.stride(2) == 1 and v.stride(2) == 1
    assert cos.shape == sin.shape and cos.shape[1] == dim
    assert cos.stride() == sin.stride() and cos.stride(1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert qk.dtype == v.dtype == k_cache.dtype == v_cache.dtype
    if tokens == 0:
        return
    _rope_cache_kernel[(tokens,)](
        qk,
        v,
        positions,
        slots,
        cos,
        sin,
        k_cache,
        v_cache,
        qk.stride(0),
        qk.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_cache.stride(0),
        NUM_HEADS=rows - kv_heads,
        NUM_KV_HEADS=kv_heads,
        HEAD_DIM=dim,
        HALF=dim // 2,
        BLOCK_R=next_pow2(rows),
        BLOCK_HALF=next_pow2(dim // 2),
        BLOCK_KV=next_pow2(kv_heads),
        BLOCK_D=next_pow2(dim),
        num_warps=4,
    )


class TritonRopeCacheWrite:
    """The same call as gpu.cpu.rope_write.RopeCacheWrite, for CUDA tensors of any float dtype."""

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
        return device.type == "cuda" and head_dim % 2 == 0

    def __call__(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        layer: int,
        slots: torch.Tensor,
    ) -> None:
        rope_cache_write(qk, v, positions, cos, sin, cache.k[layer], cache.v[layer], slots)
