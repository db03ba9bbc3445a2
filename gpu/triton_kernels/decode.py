"""Paged decode attention: one query token per row, K/V read in place from the paged cache by block table.

Cache layout (gpu/kv_cache.py): one layer's K (and V) is [kv_heads, num_blocks, block_size, head_dim]; the
key at position p of a row lives in block tables[row, p // block_size] at offset p % block_size.

One program per (row, KV head, split) holds all G query heads of that KV head (GQA: the keys are read once
for the group, and the G heads fill the rows of one tl.dot), and runs an online softmax over its split of
the context. With one split it writes the output directly; with several (long contexts, few rows) each
split writes its partial max, sum and unnormalised output, and a second kernel merges them.

The split count (the grid) is fixed on the host, from the longest context the step can hold (a decode
graph's table width) or has (an eager step's longest row); each row then divides its own keys (those in
its window) evenly over the splits, so a row as long as the batch's longest uses every split and a short
one finishes in the first. No host reads of device data: it can run in a CUDA graph.

Reference: gpu.cuda.attention.decode_attention (gather + SDPA), which it replaces on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.triton_kernels import next_pow2

BLOCK_N = 64  # keys per inner tile
MIN_SPLIT_KEYS = 256  # a split shorter than this costs more in partial writes and the reduce than it gains
MAX_SPLITS = 16
# Split only while rows * kv_heads * splits stays under this: ~4 programs per SM of an H100/H200 (132 SMs);
# beyond it the GPU is already full without splitting.
TARGET_PROGRAMS = 512
LOG2E = 1.4426950408889634
# The window argument of a layer without one: every key of any context is in it. Below 2^31 and never
# specialised on, so windowed and unwindowed layers share one compilation.
NO_WINDOW = (1 << 31) - 1


def choose_num_splits(max_context: int, rows: int, kv_heads: int) -> int:
    """Splits of the context: by length (>= MIN_SPLIT_KEYS keys each), capped once the grid is full."""
    by_length = triton.cdiv(max_context, MIN_SPLIT_KEYS)
    by_occupancy = triton.cdiv(TARGET_PROGRAMS, max(1, rows * kv_heads))
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


# The split count is a runtime argument (never specialised on): the decode graphs' batch buckets use up to
# eight different counts, and each constant would be one more compilation at engine start.
@triton.jit(do_not_specialize=["num_splits", "window"])
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    seats_ptr,
    lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    qk_scale,  # softmax scale * log2(e): exponentials are exp2
    softcap,  # attention logit soft-capping (used where SOFTCAP)
    window,  # sliding window: a row reads only its last `window` keys (NO_WINDOW: all)
    num_heads,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kh,
    stride_kb,
    stride_ko,
    stride_tb,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,  # the cache's block size
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for the reduce kernel
    HAS_SEATS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = False,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    table_row = tl.load(seats_ptr + row).to(tl.int64) if HAS_SEATS else row.to(tl.int64)
    context = tl.load(lens_ptr + row)
    # This row's keys (its window's), divided evenly over the splits in whole key tiles.
    first = tl.maximum(context - window, 0)
    split_len = tl.cdiv(tl.cdiv(context - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, context)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_kh
    table = tables_ptr + table_row * stride_tb

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        block = tl.load(table + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        key = block * stride_kb + (offs_n % PAGE) * stride_ko
        k_t = tl.load(  # [D, N]: loaded transposed, ready for the product
            k_base + key[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0
        )
        s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale  # [G, N]
        if SOFTCAP:  # Gemma 2: cap * tanh(score / cap), tanh(x) = 1 - 2 / (e^2x + 1); s is in log2 units
            t = s / (softcap * 1.4426950408889634)
            s = (1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0)) * (softcap * 1.4426950408889634)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_mask = n_mask[:, None] & d_mask[None, :]
        v = tl.load(v_base + key[:, None] + offs_d[None, :], mask=v_mask, other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        out = acc / l_i[:, None]  # every row has >= 1 key, so l_i > 0
        tl.store(
            out_ptr + row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # A split past the row's keys (a short row) ran no tile: m = -inf, l = 0, acc = 0, weighted 0 by
        # the reduce.
        part = (row * num_heads + heads).to(tl.int64) * num_splits + split  # [G] into [B, H, S]
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    part = (row * num_heads + head).to(tl.int64) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))  # some split holds keys (the last key's), so the max is finite
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_s * weight, 0)
    tl.store(
        out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    seats: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = BLOCK_N,
    window: int | None = None,
    softcap: float | None = None,
    max_context: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, heads, D] (rows may be strided, heads and dims dense) -> [B, heads, D].

    k_cache/v_cache: one layer, [kv_heads, num_blocks, block_size, D]. tables: [B, blocks] block ids per
    row, or with `seats` [B] the persistent [seats, blocks] table read at row seats[i]. lens: [B] keys each
    row attends to, each in 1 .. blocks * block_size; table entries past a row's length are never read.
    max_context: the longest row's length if the host knows it (an eager step), else the tables' width
    (a graph: the longest they can hold); num_splits: None chooses from it.
    window: a sliding window, each row attending to its last `window` keys only.
    out: where to write (rows may be strided, as q's), else a new tensor.
    """
    rows, heads, dim = q.shape
    kv_heads, _, page, _ = k_cache.shape
    assert heads % kv_heads == 0 and q.stride(2) == 1 and q.stride(1) == dim
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and tables.stride(1) == 1
    assert q.dtype == k_cache.dtype == v_cache.dtype
    if out is None:
        out = torch.empty((rows, heads, dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1 and out.stride(1) == dim
    if rows == 0:
        return out
    longest = min(max_context or tables.shape[1] * page, window or NO_WINDOW)  # the most keys a row reads
    if num_splits is None:
        num_splits = choose_num_splits(longest, rows, kv_heads)
    num_splits = max(1, min(num_splits, triton.cdiv(longest, block_n)))  # each split at least one key tile
    group = heads // kv_heads
    if num_splits > 1:
        part_acc = torch.empty((rows, heads, num_splits, dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty((rows, heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:  # unused by the kernel
        part_acc = part_m = part_l = out
    block_d = max(16, next_pow2(dim))
    _decode_kernel[(rows, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        tables,
        seats if seats is not None else lens,
        lens,
        out,
        part_acc,
        part_m,
        part_l,
        scale * LOG2E,
        softcap or 0.0,
        window or NO_WINDOW,
        heads,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=dim,
        PAGE=page,
        SPLIT=num_splits > 1,
        HAS_SEATS=seats is not None,
        BLOCK_G=max(16, next_pow2(group)),  # tl.dot needs >= 16 rows; padded heads are masked
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32, as the reference
        SOFTCAP=softcap is not None,
        num_warps=8 if block_d > 128 else 4,  # 256 dims at 4 warps: 250-254 registers a thread
    )
    if num_splits > 1:
        _reduce_kernel[(rows, heads)](
            part_acc,
            part_m,
            part_l,
            out,
            heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=dim,
            BLOCK_S=max(next_pow2(MAX_SPLITS), next_pow2(num_splits)),  # one compilation for every count
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
