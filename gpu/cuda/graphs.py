"""Decode steps replayed as CUDA graphs, all captured at engine start.

A decode-only step's host work is then one copy into the graphs' static inputs (ids, positions, slots,
lengths and seats), a gather of its seats' rows of the device's block table (gpu/cuda/tables.py) into the
static table, and one replay: no per-layer kernel launches from Python and no host syncs inside; the
greedy argmax runs inside the graph.

Keys: with the Triton paged decode kernel (which reads each row's blocks in place up to its own length),
shapes depend on the batch alone, so there is one graph per batch bucket up to max_num_seqs, captured
largest first at start (`capture_all`). The SDPA fallback gathers a fixed number of blocks per row, so
its graphs are keyed by (batch bucket, power-of-two block bucket): too many to capture up front (one per
batch and block bucket, each holding its own gathered K/V), they are captured the first time a shape
appears, before that step's inputs go into the static buffers: a capture pads every row first.

Capture and replay go through a recorder (`CudaGraphRecorder` here; tests drive the same order with one
that replays by running the body again), so the order of capture, input copies and replay is testable on
the CPU.

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
from typing import Protocol

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
# Static input vectors, one row each of DecodeGraphs.vectors (SEATS: which rows of the block table to gather)
IDS, POSITIONS, SLOTS, LENS, SEATS = range(5)
_VECTORS = 5


def bucket_of(n: int, buckets: tuple[int, ...] | list[int]) -> int:
    return next(b for b in buckets if b >= n)


def _even(n: int) -> int:
    return n + n % 2


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


class GraphRecorder(Protocol):
    def capture(
        self, body: Callable[[], DecodeOutput], warm_ups: int
    ) -> tuple[Callable[[], None], DecodeOutput]:
        """Warm `body` up (it runs on whatever the static inputs hold), record it; returns (replay, out):
        each replay runs the recorded work on the static inputs as they are then, into `out`'s tensors."""
        ...


class CudaGraphRecorder:
    """torch.cuda graphs sharing one memory pool, warmed up on one side stream: memory the caching allocator
    hands out on a stream stays cached for that stream, so a new stream per capture would strand each
    capture's warm-up memory."""

    def __init__(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()
        self._side = torch.cuda.Stream()

    def capture(
        self, body: Callable[[], DecodeOutput], warm_ups: int
    ) -> tuple[Callable[[], None], DecodeOutput]:
        # Warm-ups first: kernels compiled, library handles and choices made outside the capture.
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            for _ in range(warm_ups):
                body()
        torch.cuda.current_stream().wait_stream(self._side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = body()
        return graph.replay, out


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
        recorder: GraphRecorder | None = None,
        lora_slots: StackedSlots | None = None,
    ) -> None:
        """capture=False runs each step's body eagerly on the same static buffers: the bucketing, padding
        and kernels without CUDA graphs (how the CPU tests exercise it, on CPU tensors). recorder: how
        graphs are captured and replayed (default: CUDA graphs where capture is on)."""
        device = cache.k.device
        kernels = kernels or CudaKernels()
        self.forward, self.cache = forward, cache
        self.paged, self.argmax = kernels.decode, kernels.argmax
        self.batches = sorted({b for b in BATCH_BUCKETS if b < max_batch} | {max_batch})
        self.blocks = [max_blocks] if self.paged else block_buckets(max_blocks)
        self.trash_block = trash_block
        self._trash_slot = trash_block * cache.shape.block_size
        # Static inputs: a step of batch b copies its [5, even(b)] vectors (ids, positions, slots, lens,
        # seats; rows padded to an even length so each starts 16-byte aligned, as Triton specialises on
        # alignment) over in one plain copy into the first 5 * even(b) elements; the graph reads 4 of them.
        self._vector_storage = torch.zeros(_VECTORS * _even(max_batch), dtype=torch.long, device=device)
        self.tables = torch.full((max_batch, max_blocks), trash_block, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], tuple[Callable[[], None], DecodeOutput]] = {}
        self.recorder = recorder if recorder is not None else CudaGraphRecorder() if capture else None
        self.capture = self.recorder is not None
        # LoRA: the slots, the static vector of rows by slot (gpu/lora/slots.py) and graphs by batch bucket
        self.lora_slots = lora_slots
        self._lora_meta: torch.Tensor | None = None
        if lora_slots is not None:
            size = 2 * lora_slots.max_loras + max_batch
            self._lora_meta = torch.zeros(size, dtype=torch.long, device=device)
        self._lora_kernels = triton_kernels.available(device.type)
        self._lora_graphs: dict[tuple[int, int], tuple[Callable[[], None], DecodeOutput]] = {}

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
            if self.cache.k.is_cuda:
                torch.cuda.synchronize()
        return time.perf_counter() - start

    def vectors(self, b: int) -> torch.Tensor:
        """The static [5, b] inputs of batch b's step (a view; its rows contiguous)."""
        return self._staged_vectors(b)[:, :b]

    def _staged_vectors(self, b: int) -> torch.Tensor:
        return self._vector_storage[: _VECTORS * _even(b)].view(_VECTORS, _even(b))

    def _pad(self, b: int) -> None:
        """Every row a padding row (token 0 at position 0, one key, in the trash block): what a capture's
        warm-ups run on, at start or before the step that needs a new shape fills the buffers."""
        vectors = self.vectors(b)
        vectors[IDS:SLOTS] = 0
        vectors[SLOTS], vectors[LENS] = self._trash_slot, 1
        self.tables[:b] = self.trash_block
        if self._lora_meta is not None:  # no row under any adapter slot
            self._lora_meta.zero_()

    def _body(self, b: int, nb: int, lora: bool = False) -> DecodeOutput:
        ids, positions, slots, lens = self.vectors(b)[IDS : LENS + 1].unbind(0)
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
    ) -> tuple[Callable[[], None], DecodeOutput]:
        """Record batch b's graph over padding rows: it overwrites the static inputs of the first b rows."""
        assert self.recorder is not None
        self._pad(b)
        return self.recorder.capture(lambda: self._body(b, nb, lora), warm_ups)

    def run(
        self,
        staging: PinnedStaging,
        ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        lens: np.ndarray,
        block_tables: torch.Tensor,
        seats: np.ndarray,
        blocks: int,
        before_forward: Callable[[torch.Tensor], None] | None = None,
        lora_meta: np.ndarray | None = None,
    ) -> DecodeOutput:
        """A decode-only step of `rows` real rows (host arrays), each reading block_tables[seats[i]] up to
        lens[i] keys, the longest `blocks` blocks. block_tables: the device's (gpu/cuda/tables.py), its last
        row all trash block: the padding rows' seat. Padding and the vectors' copy are prepared on the host.
        `lora_meta`: the rows under each adapter slot (padding rows are in none); None: no adapter rows."""
        rows = len(ids)
        b, nb = self.key(rows, blocks)
        key, lora = (b, nb), lora_meta is not None
        graphs = self._lora_graphs if lora else self._graphs
        if self.capture and key not in graphs:  # LoRA graphs and the SDPA path's shapes come lazily
            # Before this step's inputs are copied in: the capture pads every row of the static buffers.
            graphs[key] = self._capture(b, nb, lora=lora)
        staged = staging.buffer("graph_vectors", (_VECTORS, _even(b)), torch.long)
        vectors = staged.numpy()[:, :b]
        vectors[IDS, :rows], vectors[POSITIONS, :rows], vectors[SLOTS, :rows] = ids, positions, slots
        vectors[LENS, :rows], vectors[SEATS, :rows] = lens, seats
        # padding rows: token 0 at position 0, one key, in the trash block
        vectors[IDS:SLOTS, rows:] = 0
        vectors[SLOTS, rows:], vectors[LENS, rows:] = self._trash_slot, 1
        vectors[SEATS, rows:] = block_tables.shape[0] - 1
        self._staged_vectors(b).copy_(staged, non_blocking=True)
        # The paged kernel reads no entry past a row's length; the SDPA path reads all nb, masked (a NaN in
        # a masked value still spreads: 0 * NaN).
        self.tables[:b, :blocks] = block_tables[:, :blocks].index_select(0, self.vectors(b)[SEATS])
        if nb > blocks and not self.paged:  # read and masked: the trash block, not a block someone holds
            self.tables[:b, blocks:nb] = self.trash_block
        if before_forward is not None:  # e.g. placeholder tokens filled on the device (gpu/runner.py)
            before_forward(self.vectors(b)[IDS, :rows])
        if lora_meta is not None:
            self._stage_lora_meta(staging, lora_meta)
        if not self.capture:
            out = self._body(b, nb, lora)
        else:
            replay, out = graphs[key]
            replay()
        return DecodeOutput(out.logits[:rows], out.greedy[:rows])

    def _stage_lora_meta(self, staging: PinnedStaging, meta: np.ndarray) -> None:
        """The step's rows by adapter slot into the static vector the LoRA graphs read."""
        assert self._lora_meta is not None
        staged = staging.buffer("graph_lora_meta", (len(meta),), torch.long)
        staged.numpy()[:] = meta
        self._lora_meta[: len(meta)].copy_(staged, non_blocking=True)
