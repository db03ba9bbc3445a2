"""Varlen paged attention for prefill and mixed steps: every chunk of a step in one launch per layer.

A step's tokens are packed: chunk i owns rows q_starts[i] .. q_starts[i] + q_lens[i] - 1, and its first
token sits at position ctx_starts[i] of its sequence (nonzero after chunked prefill or a prefix-cache hit).
Each query attends causally to keys 0 .. its own position, all read in place from the paged cache through
the chunk's block table: the chunk's own K/V must already be written there (gpu/forward.py writes them
before attention). A decode row is simply a chunk of one token.

One program per (work item, KV head), flash-attention style: a work item is one tile of one chunk, listed
on the host (the chunks' lengths are host values), so the grid holds no program past a chunk's end. A tile
holds `tokens` queries times every query head of its KV head's group (GQA: the group's G heads share the
tile's key reads, G times fewer K/V reads than a program per query head), rows token-major so a tile's
queries are contiguous in memory; online softmax over key tiles up to the tile's last query position, the
causal mask (and a sliding window) applied per element.

Reference: gpu.attention.prefill (one SDPA per chunk over a gathered context), and for a whole mixed
step gpu.attention.PagedAttention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from gpu.attention.metadata import AttentionMetadata
from gpu.triton_kernels import next_pow2

LOG2E = 1.4426950408889634
# The window argument of a layer without one; below 2^31 and never specialised on (see decode.py).
NO_WINDOW = (1 << 31) - 1


@dataclass(frozen=True)
class Tiles:
    """A tile's shape: `rows` (query tokens x the group's heads, padded to a power of two), `block_n` keys
    per inner step, `num_warps`. Chosen by head size so that no variant spills registers or outgrows an
    A100's shared memory (tests/gpu/triton_aot.py compiles and checks every one)."""

    rows: int
    block_n: int
    num_warps: int

    def tokens(self, group: int) -> int:
        """Query tokens per tile: a tile holds every head of its group for each of its tokens."""
        return max(1, self.rows // next_pow2(group))


def tiles_for(head_dim: int) -> Tiles:
    """Compiled for sm_80/sm_90 by Triton 3.6 (tests/gpu/triton_aot.py): 64 rows of 128 dims at 4 warps
    took 255 registers and spilled on sm_80, 8 warps 186-199; at 256 dims, 64-key steps spilled with 4
    warps, 32-key steps with 8 take 187-248 registers and 69-97 KB of shared memory."""
    if head_dim <= 64:
        return Tiles(64, 64, 4)
    if head_dim <= 128:
        return Tiles(64, 64, 8)
    return Tiles(64, 32, 8)


@dataclass(frozen=True)
class VarlenChunks:
    """A step's chunks in the kernel's terms; tensors on the cache's device."""

    q_starts: torch.Tensor  # [C] int64 first row of each chunk in the packed tokens
    q_lens: torch.Tensor  # [C] int64
    ctx_starts: torch.Tensor  # [C] int64 position of each chunk's first token
    seats: torch.Tensor  # [C] int64 row of the block table holding each chunk's blocks
    work: torch.Tensor  # [2, W] int32: each work item's chunk and tile
    tokens: int  # host value: query tokens per tile, the work list's unit
    num_work: int  # host value: W, the grid's first dimension

    @staticmethod
    def work_list(lens: list[int], tokens: int) -> np.ndarray:
        """[2, W] int32: (chunk, tile) for every tile of every chunk, in chunk order."""
        counts = -(-np.asarray(lens, dtype=np.int64) // tokens)
        chunk = np.repeat(np.arange(len(lens), dtype=np.int32), counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        tile = np.arange(len(chunk), dtype=np.int64) - first
        return np.stack((chunk, tile.astype(np.int32)))

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: list[int], ctx_starts: list[int], seats: list[int], device: torch.device, tokens: int
    ) -> VarlenChunks:
        """Chunks packed back to back (cu_seqlens [N + 1]), as flash-attention's varlen interface."""
        lens = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:], strict=False)]
        long = dict(dtype=torch.int64, device=device)
        work = cls.work_list(lens, tokens)
        return cls(
            torch.tensor(cu_seqlens[:-1], **long),
            torch.tensor(lens, **long),
            torch.tensor(ctx_starts, **long),
            torch.tensor(seats, **long),
            torch.from_numpy(work).to(device),
            tokens,
            work.shape[1],
        )

    @classmethod
    def from_metadata(
        cls,
        meta: AttentionMetadata,
        tokens: int,
        stage: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
        decodes: bool = True,
    ) -> VarlenChunks:
        """The step's prefill chunks, and its decode rows (one-token chunks, first) unless `decodes` is
        False (they then go to the paged decode kernel), `tokens` queries a tile.

        Device-side concatenations only: no host read of the decode tensors, which may live on the GPU. The
        host's numbers (the prefill chunks', the work list) go over in two copies, through `stage` (name,
        host tensor) -> device tensor where given (gpu/cuda/staging.py's pinned buffers: non-blocking),
        else from pageable memory."""
        device = meta.block_tables.device
        chunks = meta.prefills
        num_decodes = meta.num_decodes if decodes else 0
        # [4, C]: each of rows, lengths, starts and seats contiguous, as the kernel reads them, and each
        # 16-byte aligned (C padded to even): Triton specialises on a pointer's alignment, and an odd C
        # would compile a second variant of the kernel in the middle of serving.
        width = len(chunks) + len(chunks) % 2
        host = torch.zeros((4, width), dtype=torch.int64)
        if chunks:
            host[:, : len(chunks)] = torch.tensor(
                [[c.row_start, c.num_tokens, c.start_position, c.seat] for c in chunks], dtype=torch.int64
            ).t()
        work = torch.from_numpy(cls.work_list([1] * num_decodes + [c.num_tokens for c in chunks], tokens))
        move = stage or (lambda _, t: t.to(device, non_blocking=True))
        rows, num_tokens, starts, seats = move("varlen_chunks", host)[:, : len(chunks)]
        work_on_device = move("varlen_work", work)
        if num_decodes:
            decode_rows = meta.decode_rows.to(device)
            rows = torch.cat((decode_rows, rows))
            num_tokens = torch.cat((torch.ones_like(decode_rows), num_tokens))
            starts = torch.cat((meta.decode_lens.to(device) - 1, starts))
            seats = torch.cat((meta.decode_seats.to(device), seats))
        return cls(rows, num_tokens, starts, seats, work_on_device, tokens, work.shape[1])


# Never specialised on: `window` (windowed and unwindowed layers share a compilation) and `num_work` (the
# step's tile count: a multiple of 16 would otherwise compile another variant mid-serving).
@triton.jit(do_not_specialize=["window", "num_work"])
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
    work_ptr,  # [2, num_work]: chunk, then tile
    num_work,
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
    TOKENS: tl.constexpr,  # query tokens per tile
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two; a tile has TOKENS * BLOCK_G rows
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr = False,
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.load(work_ptr + item)
    tile = tl.load(work_ptr + num_work + item)
    q_len = tl.load(q_lens_ptr + chunk)
    q_row = tl.load(q_starts_ptr + chunk)
    ctx_start = tl.load(ctx_starts_ptr + chunk)
    table = tables_ptr + tl.load(seats_ptr + chunk).to(tl.int64) * stride_tb

    # Rows token-major: row r is query token tile * TOKENS + r // BLOCK_G, head r % BLOCK_G of the group.
    offs_r = tl.arange(0, TOKENS * BLOCK_G)
    offs_t = tile * TOKENS + offs_r // BLOCK_G
    in_group = offs_r % BLOCK_G
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = (offs_t < q_len) & (in_group < GROUP)
    d_mask = offs_d < HEAD_DIM
    positions = ctx_start + offs_t
    rows = (q_row + offs_t).to(tl.int64)
    heads = kv_head * GROUP + in_group
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_kh
    # Keys up to the tile's last query, from its first query's window on.
    hi = ctx_start + tl.minimum((tile + 1) * TOKENS, q_len)
    lo = tl.maximum(ctx_start + tile * TOKENS - window + 1, 0)

    m_i = tl.full([TOKENS * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([TOKENS * BLOCK_G], tl.float32)
    acc = tl.zeros([TOKENS * BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        block = tl.load(table + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        key = block * stride_kb + (offs_n % PAGE) * stride_ko
        k_t = tl.load(  # [D, N]: loaded transposed, ready for the product
            k_base + key[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0
        )
        s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale  # [rows, N]
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
        out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
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
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Attention of every chunk's rows of q [T, heads, D] (rows may be strided) -> out [T, heads, D].

    k_cache/v_cache: one layer, [kv_heads, num_blocks, block_size, D], already holding every chunk's own
    K/V. block_tables: [seats, max_blocks], read at chunks.seats. Rows no chunk covers are left as they
    are in `out` (uninitialised when out is None). window: a sliding window (see the kernel). The tile:
    chunks.tokens queries of every head of a group; block_n and num_warps default to `tiles_for`'s.
    """
    tokens, heads, dim = q.shape
    kv_heads, _, page, _ = k_cache.shape
    assert heads % kv_heads == 0 and q.stride(2) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and block_tables.stride(1) == 1
    assert q.dtype == k_cache.dtype == v_cache.dtype
    if out is None:
        out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1
    if chunks.num_work == 0:
        return out
    group, tiles = heads // kv_heads, tiles_for(dim)
    block_g = next_pow2(group)
    assert chunks.tokens * block_g >= 16, "tl.dot needs 16 rows: plan with tiles_for(...).tokens(group)"
    _varlen_kernel[(chunks.num_work, kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        chunks.seats,
        chunks.q_starts,
        chunks.q_lens,
        chunks.ctx_starts,
        chunks.work,
        chunks.num_work,
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
        GROUP=group,
        HEAD_DIM=dim,
        PAGE=page,
        TOKENS=chunks.tokens,
        BLOCK_G=block_g,
        BLOCK_N=block_n or tiles.block_n,
        BLOCK_D=max(16, next_pow2(dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32, as the reference
        SOFTCAP=softcap is not None,
        num_warps=num_warps or tiles.num_warps,
    )
    return out
