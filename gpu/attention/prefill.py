"""Prefill chunks through torch's fused attention (SDPA): a fresh chunk attends to its own new keys with
the causal kernel; a chunk continuing a cached prefix reads its context blocks and uses an explicit
bottom-right causal mask. GQA is handled by SDPA itself (enable_gqa), never by repeating K/V."""

from __future__ import annotations

from dataclasses import dataclass, field

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


def _softcapped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """As _sdpa with scores softcap * tanh(score / softcap) before the mask and softmax (Gemma 2's eager
    attention; SDPA has no such term). mask None: causal."""
    group = q.shape[1] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(-1, -2)) * scale  # [heads, n, L]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(0, 1)


@dataclass(frozen=True)
class PrefillPlan:
    """What a chunk needs in every layer, made once per step."""

    chunk: PrefillChunk
    blocks: torch.Tensor | None  # [1, blocks] of its context; None for a fresh chunk
    mask: torch.Tensor | None  # [n, context] bottom-right causal, True = attend; None for a fresh chunk
    windowed: dict[int, torch.Tensor] = field(default_factory=dict, compare=False)  # masks by window


def window_mask(plan: PrefillPlan, window: int, device: torch.device) -> torch.Tensor | None:
    """The chunk's mask under a sliding window (a query sees itself and the window - 1 keys before it);
    None where plain causal attention already is that (a fresh chunk no longer than the window)."""
    chunk = plan.chunk
    if chunk.start_position == 0 and chunk.num_tokens <= window:
        return None
    if window not in plan.windowed:  # made by the first windowed layer of the step, reused by the rest
        keys = torch.arange(chunk.context_len, device=device)
        queries = torch.arange(chunk.start_position, chunk.context_len, device=device)
        offset = queries[:, None] - keys[None, :]
        plan.windowed[window] = (offset >= 0) & (offset < window)
    return plan.windowed[window]


def plan_prefills(meta: AttentionMetadata, block_size: int) -> tuple[PrefillPlan, ...]:
    plans = []
    for chunk in meta.prefills:
        if chunk.start_position == 0:
            plans.append(PrefillPlan(chunk, None, None))
            continue
        context = chunk.context_len
        tables = meta.block_tables
        blocks = tables[chunk.seat, : -(-context // block_size)].unsqueeze(0)
        keys = torch.arange(context, device=tables.device)
        queries = torch.arange(chunk.start_position, context, device=tables.device)
        plans.append(PrefillPlan(chunk, blocks, keys[None, :] <= queries[:, None]))
    return tuple(plans)


def prefill_chunk(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: KVCache,
    layer: int,
    plan: PrefillPlan,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One chunk: q [n, heads, D]; k_new/v_new [n, kv_heads, D] are its own keys (already in the cache)."""
    windowed = window_mask(plan, window, q.device) if window is not None else None
    if plan.blocks is None:  # nothing cached before it: its own keys are the whole context
        k_new, v_new = k_new.transpose(0, 1), v_new.transpose(0, 1)
        if softcap is not None:
            return _softcapped(q, k_new, v_new, scale, softcap, windowed)
        if windowed is not None:
            return _sdpa(q, k_new, v_new, scale, attn_mask=windowed)
        return _sdpa(q, k_new, v_new, scale, is_causal=True)
    context = plan.chunk.context_len
    k, v = cache.gather(layer, plan.blocks)  # [kv, 1, blocks * block_size, D]
    mask = windowed if windowed is not None else plan.mask
    if softcap is not None:
        return _softcapped(q, k[:, 0, :context], v[:, 0, :context], scale, softcap, mask)
    return _sdpa(q, k[:, 0, :context], v[:, 0, :context], scale, attn_mask=mask)


def prefill_all(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: KVCache,
    layer: int,
    plans: tuple[PrefillPlan, ...],
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Every prefill chunk of the step, written into out's rows.

    One SDPA call per chunk: batching the chunks into one padded call was measured 1.5-2.5x slower on
    the CPU at this project's shapes (7-12 chunks of 16-128 tokens), the padding costing more than the
    calls it saves.
    """
    for plan in plans:
        rows = slice(plan.chunk.row_start, plan.chunk.row_start + plan.chunk.num_tokens)
        out[rows] = prefill_chunk(
            q[rows], k_new[rows], v_new[rows], cache, layer, plan, scale, window, softcap
        )
