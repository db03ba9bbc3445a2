"""Decode rows with plain torch ops: each context-length bucket gathers its sequences' blocks into a reused
scratch buffer, then two batched products and a softmax. The portable path (any device, any dtype).

Why buckets: one padded batch pads every context to the longest, so a step mixing 20- and 400-token
contexts gathered and multiplied 20x the short ones' real work. Sorting rows by context and splitting
where the length halves keeps padding under ~2x at the cost of one more product per bucket.
Why a scratch buffer: a fresh multi-megabyte gather output per layer is a fresh mmap, and its page
faults cost as much as the copy itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpu.attention.metadata import AttentionMetadata
from gpu.kv_cache import KVCache

MAX_BUCKETS = 4
MIN_BUCKET_ROWS = 8  # a smaller bucket costs more in per-call overhead than its padding saves


@dataclass(frozen=True)
class Bucket:
    rows: torch.Tensor  # [b] rows in the flattened tokens
    blocks: torch.Tensor  # [b * max_blocks] block ids, row-major; padding points at block 0 (masked)
    bias: torch.Tensor  # [1, b, 1, max_blocks * block_size]: 0 where attending, -inf past the context
    num_rows: int
    max_blocks: int
    lens: torch.Tensor | None = None  # [b] its rows' context lengths (for windowed biases)
    windowed: dict[int, torch.Tensor] = field(default_factory=dict, compare=False)  # biases by window

    def window_bias(self, window: int) -> torch.Tensor:
        """The bias under a sliding window: also -inf before the last `window` keys of each row."""
        if window not in self.windowed:  # made by the first windowed layer of the step, reused by the rest
            assert self.lens is not None
            keys = torch.arange(self.bias.shape[-1], device=self.bias.device)
            early = (keys[None, :] < (self.lens[:, None] - window))[None, :, None, :]
            self.windowed[window] = self.bias.masked_fill(early, float("-inf"))
        return self.windowed[window]


def plan_buckets(meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> tuple[Bucket, ...]:
    """Split the step's decode rows into context-length buckets (host work, once per step)."""
    if meta.num_decodes == 0:
        return ()
    lens = meta.decode_lens
    order = torch.argsort(lens, descending=True)
    sorted_lens = lens[order].tolist()
    cuts, head = [0], 0
    for i, length in enumerate(sorted_lens):
        if (
            len(cuts) < MAX_BUCKETS
            and i - head >= MIN_BUCKET_ROWS
            and len(sorted_lens) - i >= MIN_BUCKET_ROWS
            and 2 * length <= sorted_lens[head]
        ):
            cuts.append(i)
            head = i
    cuts.append(len(sorted_lens))
    if len(cuts) == 2:  # one bucket: keep row order, so contiguous rows stay a slice
        order = torch.arange(len(sorted_lens))
        sorted_lens = lens.tolist()
    buckets = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        members = order[a:b]
        longest = max(sorted_lens[a:b])
        max_blocks = -(-longest // block_size)
        tables = meta.block_tables[meta.decode_seats[members], :max_blocks]
        member_lens = lens[members]
        keys = torch.arange(max_blocks * block_size)
        bias = torch.zeros(1, b - a, 1, keys.numel(), dtype=dtype)
        bias.masked_fill_((keys[None, :] >= member_lens[:, None])[None, :, None, :], float("-inf"))
        # A row's table past its own blocks holds stale ids; point them at block 0 (masked anyway).
        valid = keys[::block_size][None, :] < member_lens[:, None]
        buckets.append(
            Bucket(
                meta.decode_rows[members],
                torch.where(valid, tables, 0).reshape(-1),
                bias,
                b - a,
                max_blocks,
                member_lens,
            )
        )
    return tuple(buckets)


class DecodeScratch:
    """Reused gather outputs, grown on demand."""

    def __init__(self) -> None:
        self._k = torch.empty(0)
        self._v = torch.empty(0)

    def views(self, cache: KVCache, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = cache.shape
        shape = (s.num_kv_heads, num_blocks, s.block_size, s.head_dim)
        numel = s.num_kv_heads * num_blocks * s.block_size * s.head_dim
        if self._k.numel() < numel or self._k.dtype != s.dtype or self._k.device != cache.k.device:
            self._k = torch.empty(numel, dtype=s.dtype, device=cache.k.device)
            self._v = torch.empty(numel, dtype=s.dtype, device=cache.k.device)
        return self._k[:numel].view(shape), self._v[:numel].view(shape)


def decode_bucket(
    q: torch.Tensor,
    cache: KVCache,
    layer: int,
    bucket: Bucket,
    scale: float,
    scratch: DecodeScratch,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [b, heads, D] of the bucket's rows -> [b, heads, D]."""
    b, heads, dim = q.shape
    kv_heads = cache.shape.num_kv_heads
    k, v = scratch.views(cache, bucket.blocks.numel())
    torch.index_select(cache.k[layer], 1, bucket.blocks, out=k)
    torch.index_select(cache.v[layer], 1, bucket.blocks, out=v)
    k, v = k.view(kv_heads, b, -1, dim), v.view(kv_heads, b, -1, dim)
    qg = q.view(b, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [kv, b, G, D]
    bias = bucket.bias if window is None else bucket.window_bias(window)
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)  # [kv, b, G, L]
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores.add_(bias)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(0, 1).reshape(b, heads, dim)
