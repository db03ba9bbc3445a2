"""Attention over the paged cache on CUDA with torch's SDPA kernels (memory-efficient / flash backends).

Decode rows gather a fixed number of blocks per row and mask past each row's length, so the shapes
depend only on (rows, blocks): the same code runs eagerly and inside a captured CUDA graph. Prefill
chunks use the same SDPA path as the CPU (gpu/attention/prefill.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu.attention.metadata import AttentionMetadata
from gpu.attention.prefill import PrefillPlan, plan_prefills, prefill_all
from gpu.kv_cache import KVCache

# Decode attention kernel on CUDA: "sdpa" (below, the reference) or "triton" (gpu/triton_kernels/decode.py:
# reads blocks in place, split-K). "triton" is not yet validated on a GPU: the device check sets it.
DECODE_KERNEL = "sdpa"


def decode_attention(
    q: torch.Tensor, cache: KVCache, layer: int, tables: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, heads, D]; tables [B, blocks] (every entry a valid block id); lens [B] -> [B, heads, D]."""
    if DECODE_KERNEL == "triton" and q.is_cuda:  # never taken on the CPU: triton is not even imported
        from gpu.triton_kernels.decode import paged_decode_attention

        return paged_decode_attention(q, cache.k[layer], cache.v[layer], tables, lens, scale)
    b, blocks = tables.shape
    s = cache.shape
    flat = tables.reshape(-1)
    k = cache.k[layer].index_select(1, flat).view(s.num_kv_heads, b, blocks * s.block_size, s.head_dim)
    v = cache.v[layer].index_select(1, flat).view(s.num_kv_heads, b, blocks * s.block_size, s.head_dim)
    keys = torch.arange(blocks * s.block_size, device=q.device)
    mask = (keys[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, L]: True = attend
    # GQA without enable_gqa (which the masked memory-efficient kernel lacks): a KV head's G query heads
    # become G query positions of that head, all attending to the same keys.
    heads = q.shape[1]
    grouped = q.reshape(b, s.num_kv_heads, heads // s.num_kv_heads, s.head_dim)
    out = F.scaled_dot_product_attention(
        grouped, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.reshape(b, heads, s.head_dim)


@dataclass(frozen=True)
class CudaPlan:
    meta: AttentionMetadata
    decode_tables: torch.Tensor | None  # [B, blocks] on the device
    prefills: tuple[PrefillPlan, ...]


class CudaPagedAttention:
    """The eager (mixed-step) backend; same interface as gpu.attention.PagedAttention."""

    decode = "cuda-sdpa"

    def plan(self, meta: AttentionMetadata, cache: KVCache) -> CudaPlan:
        prefills = plan_prefills(meta, cache.shape.block_size)
        if meta.num_decodes == 0:
            return CudaPlan(meta, None, prefills)
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
    ) -> torch.Tensor:
        meta = plan.meta
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan.decode_tables is not None:
            rows = meta.decode_rows
            out[rows] = decode_attention(q[rows], cache, layer, plan.decode_tables, meta.decode_lens, scale)
        if plan.prefills:
            prefill_all(q, k_new, v_new, cache, layer, plan.prefills, scale, out)
        return out
