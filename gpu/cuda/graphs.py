"""Decode steps replayed as CUDA graphs: one graph per (batch bucket, context-blocks bucket), captured the
first time that shape is needed and replayed from then on.

A decode-only step's host work is then a few copies into the graphs' static inputs and one replay: no
per-layer kernel launches from Python and no host syncs inside. Rows past the real batch (padding up
to the bucket) read one reserved "trash" block and write their K/V into it, so they never touch a live
sequence's cache. All graphs share one memory pool: they never run at the same time, and a step's
logits are read back before the next replay.
"""

from __future__ import annotations

import torch

from gpu.cuda.attention import decode_attention
from gpu.cuda.staging import PinnedStaging
from gpu.forward import LlamaForward
from gpu.kv_cache import KVCache

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)


def bucket_of(n: int, buckets: tuple[int, ...] | list[int]) -> int:
    return next(b for b in buckets if b >= n)


def block_buckets(max_blocks: int) -> list[int]:
    """Powers of two up to max_blocks (and max_blocks itself): at most 2x the blocks a step needs."""
    out, b = [], 1
    while b < max_blocks:
        out.append(b)
        b *= 2
    return [*out, max_blocks]


class DecodeGraphs:
    def __init__(
        self,
        forward: LlamaForward,
        cache: KVCache,
        max_batch: int,
        max_blocks: int,
        trash_block: int,
        capture: bool = True,
    ) -> None:
        """capture=False runs each step's body eagerly on the same static buffers: the bucketing and
        padding logic without CUDA graphs (how the CPU tests exercise it)."""
        device = cache.k.device
        self.forward, self.cache = forward, cache
        self.batches = sorted({b for b in BATCH_BUCKETS if b < max_batch} | {max_batch})
        self.blocks = block_buckets(max_blocks)
        self.trash_block = trash_block
        trash_slot = trash_block * cache.shape.block_size
        long = dict(dtype=torch.long, device=device)
        self.ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(max_batch, **long)
        self.slots = torch.full((max_batch,), trash_slot, **long)
        self.tables = torch.full((max_batch, max_blocks), trash_block, **long)
        self.lens = torch.ones(max_batch, **long)
        self._trash_slot = trash_slot
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture = capture
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def covers(self, rows: int, blocks: int) -> bool:
        return rows <= self.batches[-1] and blocks <= self.blocks[-1]

    def _body(self, b: int, nb: int) -> torch.Tensor:
        tables, lens, scale = self.tables[:b, :nb], self.lens[:b], self.forward.scale

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            return decode_attention(q, self.cache, layer, tables, lens, scale)

        return self.forward.run(self.ids[:b], self.positions[:b], self.slots[:b], self.cache, attend, None)

    def _capture(self, b: int, nb: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up on a side stream first: library handles and kernel choices are made outside the graph.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body(b, nb)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._body(b, nb)
        return graph, out

    def run(
        self,
        staging: PinnedStaging,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [rows, vocab] of a decode-only step; all inputs are host tensors of its real rows."""
        rows, blocks = tables.shape
        b, nb = bucket_of(rows, self.batches), bucket_of(blocks, self.blocks)
        if rows < b:  # padding rows: the trash block, one key, token 0 at position 0
            self.ids[rows:b].zero_()
            self.positions[rows:b].zero_()
            self.slots[rows:b].fill_(self._trash_slot)
            self.tables[rows:b, :nb].fill_(self.trash_block)
            self.lens[rows:b].fill_(1)
        if blocks < nb:
            self.tables[:rows, blocks:nb].fill_(self.trash_block)
        staging.into("graph_ids", ids, self.ids)
        staging.into("graph_positions", positions, self.positions)
        staging.into("graph_slots", slots, self.slots)
        staging.into("graph_lens", lens, self.lens)
        staging.into("graph_tables", tables, self.tables[:, :blocks])
        if not self.capture:
            return self._body(b, nb)[:rows]
        key = (b, nb)
        if key not in self._graphs:
            self._graphs[key] = self._capture(b, nb)
        graph, out = self._graphs[key]
        graph.replay()
        return out[:rows]
