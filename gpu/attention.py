"""Attention over the paged KV cache for a mixed step: one padded batch of decodes, then each prefill chunk.

GQA without repeating K/V: query heads are viewed as [kv_heads, group] so each KV head is read once.
"""

from __future__ import annotations

import torch

from gpu.inputs import DecodeBatch, PrefillChunk, StepInputs
from gpu.kv_cache import KVCache


def _decode(q: torch.Tensor, cache: KVCache, layer: int, batch: DecodeBatch, scale: float) -> torch.Tensor:
    """q: [B, heads, head_dim] -> [B, heads, head_dim]."""
    b, heads, dim = q.shape
    kv_heads = cache.shape.num_kv_heads
    k, v = cache.gather(layer, batch.block_tables)  # [kv, B, L, D]
    qg = q.view(b, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [kv, B, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale).add_(batch.bias)  # [kv, B, G, L]
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(0, 1).reshape(b, heads, dim)


def _prefill(q: torch.Tensor, cache: KVCache, layer: int, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    """q: [n, heads, head_dim] of one chunk -> [n, heads, head_dim], causal over its context."""
    n, heads, dim = q.shape
    kv_heads = cache.shape.num_kv_heads
    group = heads // kv_heads
    flat = (kv_heads, -1, dim)
    k = cache.k[layer].index_select(1, chunk.block_table).view(flat)  # [kv, blocks * block_size, D]
    v = cache.v[layer].index_select(1, chunk.block_table).view(flat)
    qg = q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(kv_heads, group, n, -1)
    probs = torch.softmax(scores.mul_(scale).add_(chunk.causal_bias), dim=-1)  # [kv, G, n, keys]
    out = torch.matmul(probs.view(kv_heads, group * n, -1), v).view(kv_heads, group, n, dim)
    return out.permute(2, 0, 1, 3).reshape(n, heads, dim)


def paged_attention(
    q: torch.Tensor, cache: KVCache, layer: int, inputs: StepInputs, scale: float
) -> torch.Tensor:
    """q: [T, heads, head_dim] for every flattened token, whose K/V are already in the cache."""
    batch = inputs.decode
    if batch is not None and batch.contiguous and not inputs.prefills:
        return _decode(q, cache, layer, batch, scale)
    out = torch.empty_like(q)
    if batch is not None:
        out[batch.rows] = _decode(q[batch.rows], cache, layer, batch, scale)
    for chunk in inputs.prefills:
        rows = slice(chunk.row_start, chunk.row_start + chunk.num_tokens)
        out[rows] = _prefill(q[rows], cache, layer, chunk, scale)
    return out
