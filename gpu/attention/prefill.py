"""Prefill chunks through torch's fused attention (SDPA): a fresh chunk attends to its own new keys with
the causal kernel; a chunk continuing a cached prefix reads its context blocks and uses an explicit
bottom-right causal mask. GQA is handled by SDPA itself (enable_gqa), never by repeating K/V."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.attention.metadata import AttentionMetadata, PrefillChunk
from gpu.kv_cache import KVCache


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **mask: object) -> torch.Tensor:
    """q [n, heads, D], k/v [kv_heads, L, D] -> [n, heads, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale=scale, enable_gqa=True, **mask
    )
    return out[0].transpose(0, 1)


def prefill_chunk(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: KVCache,
    layer: int,
    chunk: PrefillChunk,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One chunk: q [n, heads, D]; k_new/v_new [n, kv_heads, D] are its own keys (already in the cache)."""
    if chunk.start_position == 0:  # nothing cached before it: its own keys are the whole context
        return _sdpa(q, k_new.transpose(0, 1), v_new.transpose(0, 1), scale, is_causal=True)
    context = chunk.context_len
    blocks = block_tables[chunk.seat, : -(-context // cache.shape.block_size)]
    k, v = cache.gather(layer, blocks.unsqueeze(0))  # [kv, 1, blocks * block_size, D]
    keys = torch.arange(context, device=q.device)
    queries = torch.arange(chunk.start_position, context, device=q.device)
    mask = keys[None, :] <= queries[:, None]  # True = attend (SDPA's convention)
    return _sdpa(q, k[:, 0, :context], v[:, 0, :context], scale, attn_mask=mask)


def prefill_all(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Every prefill chunk of the step, written into out's rows."""
    for chunk in meta.prefills:
        rows = slice(chunk.row_start, chunk.row_start + chunk.num_tokens)
        out[rows] = prefill_chunk(
            q[rows], k_new[rows], v_new[rows], cache, layer, chunk, meta.block_tables, scale
        )
