"""Attention over the paged cache on CUDA: the Triton kernels where chosen at start (gpu/cuda/kernels.py),
torch's SDPA otherwise (their reference and fallback).

- Decode rows, Triton: `paged_decode` reads each row's blocks in place by block table, up to its own
  length; the shapes depend only on the rows, so a decode graph is keyed by batch size alone.
- Decode rows, SDPA: `decode_attention` gathers a fixed number of blocks per row and masks past each
  row's length, so the shapes depend on (rows, blocks): graphs are keyed by both.
- Prefill and mixed steps, Triton: one varlen call per layer covers every prefill chunk; a mixed step's
  decode rows go to the paged decode kernel where it is chosen too (a one-token row would otherwise take a
  whole prefill tile, and one long row would run serially where the decode kernel splits it), else they
  are one-token chunks of the varlen call.
- Prefill chunks, SDPA: one call per chunk (gpu/attention/prefill.py, as on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gpu.attention.metadata import AttentionMetadata
from gpu.attention.prefill import PrefillPlan, plan_for, prefill_all
from gpu.cuda.kernels import CudaKernels
from gpu.cuda.staging import PinnedStaging
from gpu.kv_cache import KVCache


def paged_decode(
    q: torch.Tensor,
    cache: KVCache,
    layer: int,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    seats: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    max_context: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel: tables [B or seats, blocks], read at row i (or seats[i]) up to lens[i] keys;
    max_context: the longest row where the host knows it (its split count follows it)."""
    from gpu.triton_kernels.decode import paged_decode_attention

    k, v = cache.k[layer], cache.v[layer]
    return paged_decode_attention(
        q, k, v, tables, lens, scale, seats, window=window, softcap=softcap, max_context=max_context, out=out
    )


def decode_attention(
    q: torch.Tensor,
    cache: KVCache,
    layer: int,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The SDPA reference: q [B, heads, D]; tables [B, blocks] (every entry a valid block id); lens [B]."""
    b, blocks = tables.shape
    s = cache.shape
    flat = tables.reshape(-1)
    k = cache.k[layer].index_select(1, flat).view(s.num_kv_heads, b, blocks * s.block_size, s.head_dim)
    v = cache.v[layer].index_select(1, flat).view(s.num_kv_heads, b, blocks * s.block_size, s.head_dim)
    keys = torch.arange(blocks * s.block_size, device=q.device)
    mask = keys[None, :] < lens[:, None]
    if window is not None:  # a sliding window: only the last `window` keys
        mask &= keys[None, :] >= lens[:, None] - window
    mask = mask[:, None, None, :]  # [B, 1, 1, L]: True = attend
    # GQA without enable_gqa (which the masked memory-efficient kernel lacks): a KV head's G query heads
    # become G query positions of that head, all attending to the same keys.
    heads = q.shape[1]
    grouped = q.reshape(b, s.num_kv_heads, heads // s.num_kv_heads, s.head_dim)
    if softcap is not None:  # SDPA has no soft-capping term: the same product written out
        scores = torch.matmul(grouped, k.transpose(0, 1).transpose(-1, -2)) * scale
        scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v.transpose(0, 1))
    else:
        out = F.scaled_dot_product_attention(
            grouped, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
        )
    return out.reshape(b, heads, s.head_dim)


@dataclass(frozen=True)
class CudaPlan:
    meta: AttentionMetadata
    decode_tables: torch.Tensor | None  # [B, blocks] on the device (the SDPA decode path)
    prefills: tuple[PrefillPlan, ...]  # the SDPA prefill path
    varlen: Any = None  # gpu.triton_kernels.prefill.VarlenChunks: the prefill chunks in one call per layer


class CudaPagedAttention:
    """The eager (prefill and mixed-step) backend; same interface as gpu.attention.PagedAttention."""

    def __init__(
        self, kernels: CudaKernels | None = None, staging: PinnedStaging | None = None, group: int = 1
    ) -> None:
        """staging: the step's pinned buffers, for the varlen plan's host-to-device copies. group: query
        heads per KV head (the varlen kernel's tiles hold a whole group)."""
        self.kernels = kernels or CudaKernels()
        self.staging = staging
        self.group = group
        self.decode = "cuda-triton" if self.kernels.decode else "cuda-sdpa"  # the name the engine logs

    def plan(self, meta: AttentionMetadata, cache: KVCache) -> CudaPlan:
        if self.kernels.varlen and (meta.prefills or not self.kernels.decode):
            from gpu.triton_kernels.prefill import VarlenChunks, tiles_for

            stage = self.staging.to_device if self.staging is not None else None
            tokens = tiles_for(cache.shape.head_dim).tokens(self.group)
            apart = self.kernels.decode and meta.num_decodes > 0  # decode rows to the paged decode kernel
            varlen = VarlenChunks.from_metadata(meta, tokens, stage, decodes=not apart)
            return CudaPlan(meta, meta.block_tables if apart else None, (), varlen)
        prefills = plan_for(meta, cache)
        if meta.num_decodes == 0:
            return CudaPlan(meta, None, prefills)
        if self.kernels.decode:  # the kernel reads the persistent table by seat
            return CudaPlan(meta, meta.block_tables, prefills)
        blocks = -(-meta.max_decode_len // cache.shape.block_size)
        tables = meta.block_tables[meta.decode_seats, :blocks]
        # Entries past a row's own blocks are stale ids of earlier sequences: valid ids, masked anyway.
        return CudaPlan(meta, tables, prefills)

    def __call__(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        cache: KVCache,
        layer: int,
        plan: CudaPlan,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        meta = plan.meta
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan.varlen is not None:  # every prefill chunk (and the decode rows, unless decoded apart)
            from gpu.triton_kernels.prefill import varlen_paged_attention

            k, v = cache.k[layer], cache.v[layer]
            tables, chunks = meta.block_tables, plan.varlen
            varlen_paged_attention(q, k, v, tables, chunks, scale, out, window=window, softcap=softcap)
        if plan.decode_tables is not None:
            rows, lens, tables = meta.decode_rows, meta.decode_lens, plan.decode_tables
            if self.kernels.decode:
                seats, longest = meta.decode_seats, meta.max_decode_len
                first = meta.decode_first
                if first is not None:  # contiguous rows: read and written in place
                    span = slice(first, first + meta.num_decodes)
                    options = dict(window=window, softcap=softcap, max_context=longest, out=out[span])
                    paged_decode(q[span], cache, layer, tables, lens, scale, seats, **options)
                else:
                    out[rows] = paged_decode(
                        q[rows], cache, layer, tables, lens, scale, seats, window, softcap, longest
                    )
            else:
                out[rows] = decode_attention(q[rows], cache, layer, tables, lens, scale, window, softcap)
        if plan.prefills:
            prefill_all(q, k_new, v_new, cache, layer, plan.prefills, scale, out, window, softcap)
        return out
