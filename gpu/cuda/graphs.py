"""Decode steps replayed as CUDA graphs, all captured at engine start.

A decode-only step's host work is then two copies into the graphs' static inputs and one replay: no
per-layer kernel launches from Python and no host syncs inside; the greedy argmax runs inside the graph.

Keys: with the Triton paged decode kernel (which reads each row's blocks in place up to its own length),
shapes depend on the batch alone, so there is one graph per batch bucket up to max_num_seqs, captured
largest first at start (`capture_all`). The SDPA fallback gathers a fixed number of blocks per row, so
its graphs are keyed by (batch bucket, power-of-two block bucket): too many to capture up front, they are
captured the first time a shape appears.

A step with LoRA rows replays a graph of its own per batch bucket (captured the first time one is needed:
base-only steps never run a LoRA kernel): the same body with the shrink/expand kernels over the adapters'
stacked slots, reading which rows use which slot from a static vector the step copies in first.

Rows past the real batch (padding up to the bucket) read one reserved "trash" block and write their K/V
into it, so they never touch a live sequence's cache. All graphs share one memory pool: they never run at
the same time, and a step's outputs are read back before the next replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from gpu import triton_kernels
from gpu.cuda.attention import decode_attention, paged_decode
from gpu.cuda.kernels import CudaKernels
from gpu.cuda.staging import PinnedStaging
from gpu.forward import LlamaForward
from gpu.kv_cache import KVCache
from gpu.lora.slots import SlotLora, StackedSlots

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)
# Static input vectors, one row each of DecodeGraphs.vectors
IDS, POSITIONS, SLOTS, LENS = range(4)


def bucket_of(n: int, buckets: tuple[int, ...] | list[int]) -> int:
    return next(b for b in buckets if b >= n)


def block_buckets(max_blocks: int) -> list[int]:
    """Powers of two up to max_blocks (and max_blocks itself): at most 2x the blocks a step needs."""
    out, b = [], 1
    while b < max_blocks:
        out.append(b)
        b *= 2
    return [*out, max_blocks]


@dataclass(frozen=True)
class DecodeOutput:
    logits: torch.Tensor  # [rows, vocab] float32 on the device
    greedy: torch.Tensor  # [rows] int64: each row's argmax, computed with the logits


class DecodeGraphs:
    def __init__(
        self,
        forward: LlamaForward,
        cache: KVCache,
        max_batch: int,
        max_blocks: int,
        trash_block: int,
        kernels: CudaKernels | None = None,
        capture: bool = True,
        lora_slots: StackedSlots | None = None,
    ) -> None:
        """capture=False runs each step's body eagerly on the same static buffers: the bucketing, padding
        and kernels without CUDA graphs (how the CPU tests exercise it, on CPU tensors)."""
        device = cache.k.device
        kernels = kernels or CudaKernels()
        self.forward, self.cache = forward, cache
        self.paged, self.argmax = kernels.decode, kernels.argmax
        self.batches = sorted({b for b in BATCH_BUCKETS if b < max_batch} | {max_batch})
        self.blocks = [max_blocks] if self.paged else block_buckets(max_blocks)
        self.trash_block = trash_block
        self._trash_slot = trash_block * cache.shape.block_size
        # Static inputs: a graph of batch b reads the first 4 * b elements as [4, b] (ids, positions,
        # slots, lens), contiguous, so a step's staged [4, b] goes over in one plain copy.
        self._vector_storage = torch.zeros(4 * max_batch, dtype=torch.long, device=device)
        self.tables = torch.full((max_batch, max_blocks), trash_block, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, DecodeOutput]] = {}
        self.capture = capture
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        # LoRA: the slots, the static vector of rows by slot (gpu/lora/slots.py) and graphs by batch bucket
        self.lora_slots = lora_slots
        self._lora_meta: torch.Tensor | None = None
        if lora_slots is not None:
            size = 2 * lora_slots.max_loras + max_batch
            self._lora_meta = torch.zeros(size, dtype=torch.long, device=device)
        self._lora_kernels = triton_kernels.available(device.type)
        self._lora_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, DecodeOutput]] = {}

    def covers(self, rows: int, blocks: int) -> bool:
        return rows <= self.batches[-1] and blocks <= self.blocks[-1]

    def key(self, rows: int, blocks: int) -> tuple[int, int]:
        """(batch bucket, block bucket); the block bucket is always the widest with the paged kernel."""
        nb = self.blocks[-1] if self.paged else bucket_of(blocks, self.blocks)
        return bucket_of(rows, self.batches), nb

    def capture_all(self) -> float:
        """Capture every batch bucket's graph (paged kernel only), largest first so the smaller ones
        reuse its pool; returns the seconds it took."""
        start = time.perf_counter()
        if self.capture and self.paged:
            with torch.no_grad():
                for b in reversed(self.batches):
                    key = (b, self.blocks[-1])
                    if key not in self._graphs:
                        self._graphs[key] = self._capture(*key, warm_ups=1 if self._graphs else 2)
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def vectors(self, b: int) -> torch.Tensor:
        """The static [4, b] inputs of batch b's graph (a contiguous view)."""
        return self._vector_storage[: 4 * b].view(4, b)

    def _pad(self, b: int) -> None:
        """Every row a padding row (token 0 at position 0, one key, in the trash block): what warm-ups and
        captures at start read before a step fills them."""
        vectors = self.vectors(b)
        vectors[IDS:SLOTS] = 0
        vectors[SLOTS], vectors[LENS] = self._trash_slot, 1

    def _body(self, b: int, nb: int, lora: bool = False) -> DecodeOutput:
        ids, positions, slots, lens = self.vectors(b).unbind(0)
        tables, scale = self.tables[:b, :nb], self.forward.scale
        attention = paged_decode if self.paged else decode_attention

        options = self.forward.attn_options  # a layer's sliding window, Gemma 2's soft-capping

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            return attention(q, self.cache, layer, tables, lens, scale, **options[layer])

        apply = None
        if lora:
            assert self.lora_slots is not None and self._lora_meta is not None
            apply = SlotLora(self.lora_slots, self._lora_meta, b, self._lora_kernels)
        logits = self.forward.run(ids, positions, slots, self.cache, attend, None, apply)
        if self.argmax:
            from gpu.triton_kernels.argmax import greedy_argmax

            return DecodeOutput(logits, greedy_argmax(logits))
        return DecodeOutput(logits, logits.argmax(dim=-1))

    def _capture(
        self, b: int, nb: int, warm_ups: int = 2, lora: bool = False
    ) -> tuple[torch.cuda.CUDAGraph, DecodeOutput]:
        # Warm-ups on a side stream first: kernels compiled, library handles and choices made outside.
        self._pad(b)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warm_ups):
                self._body(b, nb, lora)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._body(b, nb, lora)
        return graph, out

    def run(
        self,
        staging: PinnedStaging,
        ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        lens: np.ndarray,
        block_tables: np.ndarray,
        seats: np.ndarray,
        blocks: int,
        before_forward: Callable[[torch.Tensor], None] | None = None,
        lora_meta: np.ndarray | None = None,
    ) -> DecodeOutput:
        """A decode-only step of `rows` real rows (host arrays), each reading block_tables[seats[i]] up to
        lens[i] keys, the longest `blocks` blocks. Padding and both copies are prepared on the host.
        `lora_meta`: the rows under each adapter slot (padding rows are in none); None: no adapter rows."""
        rows = len(ids)
        b, nb = self.key(rows, blocks)
        staged = staging.buffer("graph_vectors", (4, b), torch.long)
        vectors = staged.numpy()
        vectors[IDS, :rows], vectors[POSITIONS, :rows], vectors[SLOTS, :rows] = ids, positions, slots
        vectors[LENS, :rows] = lens
        # padding rows: token 0 at position 0, one key, in the trash block
        vectors[IDS:SLOTS, rows:] = 0
        vectors[SLOTS, rows:], vectors[LENS, rows:] = self._trash_slot, 1
        # The paged kernel reads no entry past a row's length; the SDPA path reads all nb, masked.
        width = blocks if self.paged else nb
        tables = staging.buffer("graph_tables", (b, width), torch.long)
        table_rows = tables.numpy()
        table_rows[:rows, :blocks] = block_tables[seats, :blocks]
        table_rows[:rows, blocks:] = self.trash_block
        table_rows[rows:] = self.trash_block
        self.vectors(b).copy_(staged, non_blocking=True)
        self.tables[:b, :width].copy_(tables, non_blocking=True)
        if before_forward is not None:  # e.g. placeholder tokens filled on the device (gpu/runner.py)
            before_forward(self.vectors(b)[IDS, :rows])
        if lora_meta is not None:
            return self._run_lora(staging, b, nb, rows, lora_meta)
        if not self.capture:
            out = self._body(b, nb)
        else:
            key = (b, nb)
            if key not in self._graphs:  # only the SDPA path's lazily captured shapes
                self._graphs[key] = self._capture(b, nb)
            graph, out = self._graphs[key]
            graph.replay()
        return DecodeOutput(out.logits[:rows], out.greedy[:rows])

    def _run_lora(self, staging: PinnedStaging, b: int, nb: int, rows: int, meta: np.ndarray) -> DecodeOutput:
        """The step's rows by slot into the static vector, then the LoRA graph of its bucket (captured now
        the first time it is needed)."""
        assert self._lora_meta is not None
        staged = staging.buffer("graph_lora_meta", (len(meta),), torch.long)
        staged.numpy()[:] = meta
        self._lora_meta[: len(meta)].copy_(staged, non_blocking=True)
        if not self.capture:
            out = self._body(b, nb, lora=True)
        else:
            key = (b, nb)
            if key not in self._lora_graphs:
                # the capture's padding would overwrite the step's inputs: they go in again after it
                saved = (self.vectors(b).clone(), self.tables[:b].clone(), self._lora_meta.clone())
                self._lora_graphs[key] = self._capture(b, nb, lora=True)
                self.vectors(b).copy_(saved[0])
                self.tables[:b].copy_(saved[1])
                self._lora_meta.copy_(saved[2])
            graph, out = self._lora_graphs[key]
            graph.replay()
        return DecodeOutput(out.logits[:rows], out.greedy[:rows])
