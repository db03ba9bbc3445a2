"""Prefill chunks through torch's fused attention (SDPA), several chunks per call.

Short chunks are packed: one SDPA call covers a pack of chunks, their rows stacked, their contexts' keys
stacked, and one mask (`attention_mask`) keeps each query to its own sequence's keys up to its own
position (block-diagonal and causal, a chunk's cached prefix included). Many short prompts then cost one
call per layer instead of one per chunk. A pack's work is rows x keys, so chunks join a pack only while its
keys stay within PACK_KEYS: past that the masked-off blocks cost more than the calls they save, and a long
chunk runs alone (a fresh one with the causal kernel, no mask). GQA is handled by SDPA (enable_gqa).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gpu.attention.metadata import AttentionMetadata, PrefillChunk
from gpu.kv_cache import KVCache

# A pack's keys at most (its contexts summed): None measures it once per shape on the CPU (`pack_keys`).
# A masked call costs rows x keys, so packing pays while a call's fixed cost dominates: on this project's
# CPU shapes one 6-token call costs ~11 us and one masked call over 48 / 128 / 384 keys ~31 / 112 / 836 us
# (one thread, 4 heads of 16): packing 8-token chunks wins up to ~128-256 keys, loses by 384.
PACK_KEYS: int | None = None
CUDA_PACK_KEYS = 1024  # on a GPU launches dominate: pack the short chunks, a long one alone
CANDIDATES = (32, 64, 128, 256, 512)
_measured: dict[tuple[int, int, torch.dtype], int] = {}


def pack_keys(kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """How many keys one packed SDPA call may cover (0: every chunk alone)."""
    if PACK_KEYS is not None:
        return PACK_KEYS
    if device.type != "cpu":
        return CUDA_PACK_KEYS
    key = (kv_heads, head_dim, dtype)
    if key not in _measured:
        _measured[key] = _measure(kv_heads, head_dim, dtype)
    return _measured[key]


def _measure(kv_heads: int, head_dim: int, dtype: torch.dtype, chunk: int = 8) -> int:
    """The largest candidate pack whose one masked call costs at most 3/4 of its `chunk`-token chunks'
    calls one by one (best of 7 runs each; query heads taken as 2 per KV head). A few ms, once."""

    def best(n_q: int, n_k: int, calls: int = 1, **mask: object) -> float:
        q = torch.randn(n_q, 2 * kv_heads, head_dim, dtype=dtype)
        k = torch.randn(kv_heads, n_k, head_dim, dtype=dtype)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(calls):
                _sdpa(q, k, k, 1.0, **mask)
            times.append((time.perf_counter() - start) / calls)
        return min(times)

    single = best(chunk, chunk, calls=20, is_causal=True)
    chosen = 0
    for keys in CANDIDATES:
        mask = torch.ones(keys, keys, dtype=torch.bool).tril()
        if best(keys, keys, attn_mask=mask) > 0.75 * single * keys / chunk:
            break
        chosen = keys
    return chosen


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
    """One SDPA call per layer: a pack of chunks (or one chunk), made once per step."""

    chunks: tuple[PrefillChunk, ...]
    rows: slice | torch.Tensor  # the pack's rows of q/out: a slice where they are contiguous
    keys: torch.Tensor | None  # [L] flat cache slots of the contexts; None: fresh chunks, keys = own rows
    mask: torch.Tensor | None  # [n, L] True = attend; None: one fresh chunk (the causal kernel)
    # each row's and each key's position (on the device), for a sliding window's term; None with mask None
    positions: tuple[torch.Tensor, torch.Tensor] | None = None
    windowed: dict[int, torch.Tensor | None] = field(default_factory=dict, compare=False)  # by window


def attention_mask(
    query_seq: torch.Tensor, query_pos: torch.Tensor, key_seq: torch.Tensor, key_pos: torch.Tensor
) -> torch.Tensor:
    """[queries, keys], True where a query attends a key: the same sequence, a key at or before the query's
    position. The one place the rule lives (a sliding window adds `within_window`)."""
    same = query_seq[:, None] == key_seq[None, :]
    return same & (key_pos[None, :] <= query_pos[:, None])


def within_window(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[queries, keys], True where a key is among the window - 1 positions before a query (or is it)."""
    return key_pos[None, :] > query_pos[:, None] - window


def window_mask(plan: PrefillPlan, window: int, device: torch.device) -> torch.Tensor | None:
    """The pack's mask under a sliding window; None where the window cuts nothing (every context no longer
    than it), so the plan's own mask (or the causal kernel) is that. Made by the step's first windowed
    layer, reused by the rest."""
    if window not in plan.windowed:
        if max(c.context_len for c in plan.chunks) <= window:
            plan.windowed[window] = None
        elif plan.mask is None:  # one fresh chunk: positions 0 .. n - 1 are its rows and its keys
            pos = torch.arange(plan.chunks[0].num_tokens, device=device)
            plan.windowed[window] = (pos[None, :] <= pos[:, None]) & within_window(pos, pos, window)
        else:
            assert plan.positions is not None
            plan.windowed[window] = plan.mask & within_window(*plan.positions, window)
    return plan.windowed[window]


def _ranges(starts: list[int], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For ranges starts[i] .. starts[i] + lens[i] - 1 laid end to end: each element's range and value."""
    lens_t = torch.tensor(lens)
    seq = torch.arange(len(lens)).repeat_interleave(lens_t)
    offsets = torch.tensor(starts) - (torch.cumsum(lens_t, 0) - lens_t)
    return seq, torch.arange(int(lens_t.sum())) + offsets[seq]


def _pack(chunks: list[PrefillChunk], tables: torch.Tensor, block_size: int) -> PrefillPlan:
    fresh = all(c.start_position == 0 for c in chunks)
    first, lens = chunks[0].row_start, [c.num_tokens for c in chunks]
    if len(chunks) == 1 and fresh:
        return PrefillPlan(tuple(chunks), slice(first, first + lens[0]), None, None)
    # queries: each chunk's rows at positions start .. start + n - 1; keys: each context's 0 .. context - 1
    query_seq, query_pos = _ranges([c.start_position for c in chunks], lens)
    key_lens = lens if fresh else [c.context_len for c in chunks]
    key_seq, key_pos = (query_seq, query_pos) if fresh else _ranges([0] * len(chunks), key_lens)
    device = tables.device
    # Only the O(rows + keys) vectors cross to the device; the [rows, keys] mask is made there.
    on = [t.to(device, non_blocking=True) for t in (query_seq, query_pos, key_seq, key_pos)]
    mask = attention_mask(*on)
    contiguous = all(
        a.row_start + a.num_tokens == b.row_start for a, b in zip(chunks, chunks[1:], strict=False)
    )
    rows = (
        slice(first, first + len(query_seq))
        if contiguous
        else _ranges([c.row_start for c in chunks], lens)[1].to(device, non_blocking=True)
    )
    keys = None
    if not fresh:  # slot of position p: block tables[seat, p // block_size], offset p % block_size
        seats = torch.tensor([c.seat for c in chunks])[key_seq]
        key_pos = on[3]
        blocks = tables[seats.to(device, non_blocking=True), key_pos // block_size]
        keys = blocks * block_size + key_pos % block_size
    return PrefillPlan(tuple(chunks), rows, keys, mask, (on[1], on[3]))


def plan_for(meta: AttentionMetadata, cache: KVCache) -> tuple[PrefillPlan, ...]:
    """The step's prefill plans, packed up to the limit measured for the cache's shape (`pack_keys`)."""
    s = cache.shape
    limit = pack_keys(s.num_kv_heads, s.head_dim, s.dtype, cache.k.device) if meta.prefills else 0
    return plan_prefills(meta, s.block_size, limit)


def plan_prefills(meta: AttentionMetadata, block_size: int, limit: int = 0) -> tuple[PrefillPlan, ...]:
    """The step's chunks in packs of at most `limit` keys (a longer chunk alone; 0: each alone), in row
    order."""
    plans, pack, keys = [], [], 0
    for chunk in sorted(meta.prefills, key=lambda c: c.row_start):
        if pack and keys + chunk.context_len > limit:
            plans.append(_pack(pack, meta.block_tables, block_size))
            pack, keys = [], 0
        pack.append(chunk)
        keys += chunk.context_len
    if pack:
        plans.append(_pack(pack, meta.block_tables, block_size))
    return tuple(plans)


def prefill_pack(
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
    """One pack: q [T, heads, D]; k_new/v_new [T, kv_heads, D] are the step's own keys (already in the
    cache). Returns the attention of the pack's rows, [n, heads, D]. `window`: the layer's sliding window;
    `softcap`: its attention logit soft-capping (Gemma 2)."""
    rows = plan.rows
    if plan.keys is None:  # fresh chunks: their own keys are the whole contexts
        k, v = k_new[rows].transpose(0, 1), v_new[rows].transpose(0, 1)
    else:
        s = cache.shape
        flat = (s.num_kv_heads, -1, s.head_dim)
        k = cache.k[layer].view(flat).index_select(1, plan.keys)
        v = cache.v[layer].view(flat).index_select(1, plan.keys)
    windowed = window_mask(plan, window, q.device) if window is not None else None
    mask = windowed if windowed is not None else plan.mask
    if softcap is not None:
        return _softcapped(q[rows], k, v, scale, softcap, mask)
    if mask is None:
        return _sdpa(q[rows], k, v, scale, is_causal=True)
    return _sdpa(q[rows], k, v, scale, attn_mask=mask)


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
    """Every prefill chunk of the step, written into out's rows: one SDPA call per pack."""
    for plan in plans:
        out[plan.rows] = prefill_pack(q, k_new, v_new, cache, layer, plan, scale, window, softcap)
