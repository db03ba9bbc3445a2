"""Varlen paged attention for prefill and mixed steps: every chunk of a step in one launch per layer.

A step's tokens are packed: chunk i owns rows q_starts[i] .. q_starts[i] + q_lens[i] - 1, and its first
token sits at position ctx_starts[i] of its sequence (nonzero after chunked prefill or a prefix-cache hit).
Each query attends causally to keys 0 .. its own position, all read in place from the paged cache through
the chunk's block table: the chunk's own K/V must already be written there (gpu/forward.py writes them
before attention). A decode row is simply a chunk of one token.

One program per (query tile, chunk, query head), flash-attention style: online softmax over key tiles up
to the tile's last query position, the causal mask applied per element. GQA reads KV head head // G.

Reference: gpu.attention.prefill (one SDPA per chunk over a gathered context), and for a whole mixed
step gpu.attention.PagedAttention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu.attention.metadata import AttentionMetadata
from gpu.triton_kernels import next_pow2

BLOCK_M = 64  # queries per tile
BLOCK_N = 64  # keys per inner tile
LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 40  # the window argument of a layer without one: every key of the context is in it


@dataclass(frozen=True)
class VarlenChunks:
    """A step's chunks in the kernel's terms; tensors [num_chunks] int64 on the cache's device."""

    q_starts: torch.Tensor  # first row of each chunk in the packed tokens
    q_lens: torch.Tensor
    ctx_starts: torch.Tensor  # position of each chunk's first token
    seats: torch.Tensor  # row of the block table holding each chunk's blocks
    max_q_len: int  # host value: sizes the grid without reading device memory

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: list[int], ctx_starts: list[int], seats: list[int], device: torch.device
    ) -> VarlenChunks:
        """Chunks packed back to back (cu_seqlens [N + 1]), as flash-attention's varlen interface."""
        lens = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:], strict=False)]
        long = dict(dtype=torch.int64, device=device)
        return cls(
            torch.tensor(cu_seqlens[:-1], **long),
            torch.tensor(lens, **long),
            torch.tensor(ctx_starts, **long),
            torch.tensor(seats, **long),
            max(lens, default=0),
        )

    @classmethod
    def from_metadata(
        cls, meta: AttentionMetadata, stage: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    ) -> VarlenChunks:
        """Every chunk of a step, decode rows (one token) and prefill chunks alike, in no particular order.

        Device-side concatenations only: no host read of the decode tensors, which may live on the GPU. The
        prefill chunks' numbers go over in one copy, through `stage` (name, host tensor) -> device tensor
        where given (gpu/cuda/staging.py's pinned buffers: non-blocking), else from pageable memory."""
        device = meta.block_tables.device
        chunks = meta.prefills
        decode_rows = meta.decode_rows.to(device)
        lens = [c.num_tokens for c in chunks] + ([1] if meta.num_decodes else [])
        host = torch.tensor(
            [[c.row_start, c.num_tokens, c.start_position, c.seat] for c in chunks], dtype=torch.int64
        ).reshape(len(chunks), 4)
        staged = stage("varlen_chunks", host) if stage is not None else host.to(device, non_blocking=True)
        rows, num_tokens, starts, seats = staged.t()
        return cls(
            torch.cat((decode_rows, rows)),
            torch.cat((torch.ones_like(decode_rows), num_tokens)),
            torch.cat((meta.decode_lens.to(device) - 1, starts)),
            torch.cat((meta.decode_seats.to(device), seats)),
            max(lens, default=0),
        )


@triton.jit
def _varlen_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    seats_ptr,
    q_starts_ptr,
    q_lens_ptr,
    ctx_starts_ptr,
    qk_scale,  # softmax scale * log2(e): exponentials are exp2
    softcap,  # attention logit soft-capping (used where SOFTCAP)
    window,  # sliding window: a query sees itself and the window - 1 keys before it (NO_WINDOW: all)
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = False,
):
    tile = tl.program_id(0)
    chunk = tl.program_id(1)
    head = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + chunk)
    q_row = tl.load(q_starts_ptr + chunk)
    ctx_start = tl.load(ctx_starts_ptr + chunk)
    table = tables_ptr + tl.load(seats_ptr + chunk).to(tl.int64) * stride_tb

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    positions = ctx_start + offs_m
    rows = (q_row + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    kv_head = (head // GROUP).to(tl.int64)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_kh
    # Keys up to the tile's last real query; a tile past its chunk's end (a shorter chunk) reads none.
    last = ctx_start + tl.minimum((tile + 1) * BLOCK_M, q_len)
    hi = tl.where(tile * BLOCK_M < q_len, last, 0)
    lo = tl.maximum(ctx_start + tile * BLOCK_M - window + 1, 0)  # the tile's first query's window

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        block = tl.load(table + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        key = block * stride_kb + (offs_n % PAGE) * stride_ko
        k_t = tl.load(  # [D, N]: loaded transposed, ready for the product
            k_base + key[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0
        )
        s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale  # [M, N]
        if SOFTCAP:  # Gemma 2: cap * tanh(score / cap), tanh(x) = 1 - 2 / (e^2x + 1); s is in log2 units
            t = s / (softcap * 1.4426950408889634)
            s = (1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0)) * (softcap * 1.4426950408889634)
        offset = positions[:, None] - offs_n[None, :]
        s = tl.where(n_mask[None, :] & (offset >= 0) & (offset < window), s, float("-inf"))
        # Under a window a row may see no key of the first tiles: its max stays -inf, so subtract 0 there
        # (every p is then 0) rather than -inf (NaN).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_mask = n_mask[:, None] & d_mask[None, :]
        v = tl.load(v_base + key[:, None] + offs_d[None, :], mask=v_mask, other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only in masked-off rows
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def varlen_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    chunks: VarlenChunks,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of every chunk's rows of q [T, heads, D] (rows may be strided) -> out [T, heads, D].

    k_cache/v_cache: one layer, [kv_heads, num_blocks, block_size, D], already holding every chunk's own
    K/V. block_tables: [seats, max_blocks], read at chunks.seats. Rows no chunk covers are left as they
    are in `out` (uninitialised when out is None). window: a sliding window (see the kernel).
    """
    tokens, heads, dim = q.shape
    kv_heads, _, page, _ = k_cache.shape
    assert heads % kv_heads == 0 and q.stride(2) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and block_tables.stride(1) == 1
    assert q.dtype == k_cache.dtype == v_cache.dtype
    if out is None:
        out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1
    num_chunks = chunks.q_lens.numel()
    if num_chunks == 0 or chunks.max_q_len == 0:
        return out
    grid = (triton.cdiv(chunks.max_q_len, block_m), num_chunks, heads)
    _varlen_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        chunks.seats,
        chunks.q_starts,
        chunks.q_lens,
        chunks.ctx_starts,
        scale * LOG2E,
        softcap or 0.0,
        window or NO_WINDOW,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=heads // kv_heads,
        HEAD_DIM=dim,
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32, as the reference
        SOFTCAP=softcap is not None,
        num_warps=4,
    )
    return out
