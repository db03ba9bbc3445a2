"""One model step on CUDA: decode-only steps through captured graphs, everything else eagerly.

`build_cuda_step` is the engine-start sequence: measure the Triton kernels against their torch paths
(gpu/cuda/kernels.py), install the chosen ones, then capture the decode graphs, logging the choice and
the time it all took.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from gpu import triton_kernels
from gpu.cuda import choice
from gpu.cuda import kernels as cuda_kernels
from gpu.cuda.attention import CudaPagedAttention
from gpu.cuda.graphs import DecodeGraphs, DecodeOutput
from gpu.cuda.kernels import CudaKernels
from gpu.cuda.staging import PinnedStaging
from gpu.cuda.tables import DeviceBlockTables
from gpu.forward import LlamaForward
from gpu.inputs import StepInputs
from gpu.kv_cache import KVCache
from gpu.lora.slots import SlotLora, StackedSlots

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepLogits:
    logits: torch.Tensor  # [S, vocab] float32 on the device, for inputs.sample_rows
    greedy: torch.Tensor | None  # [S] int64 argmax of each row, computed in the graph; None: eager step


class CudaStep:
    def __init__(
        self,
        forward: LlamaForward,
        cache: KVCache,
        max_num_seqs: int,
        max_blocks: int,
        trash_block: int | None,
        capture_graphs: bool = True,
        kernels: CudaKernels | None = None,
        lora_slots: StackedSlots | None = None,
    ) -> None:
        """kernels: the Triton kernels to use (installed into `forward` here); None: torch paths only.
        lora_slots: the adapters' device slots (gpu/lora/slots.py), applied with the Triton LoRA kernels
        (the torch reference where triton does not import, or on CPU tensors)."""
        self.forward, self.cache = forward, cache
        self.lora_slots = lora_slots
        self.lora_kernels = triton_kernels.available(cache.k.device.type)
        self.kernels = kernels or CudaKernels()
        cuda_kernels.install(forward, self.kernels)
        self.staging = PinnedStaging(cache.k.device)
        # the block table on the device, kept up to date by each step's changed entries
        self.tables = DeviceBlockTables(max_num_seqs, max_blocks, trash_block or 0, cache.k.device)
        group = forward.num_heads // forward.num_kv_heads
        self.attention = CudaPagedAttention(self.kernels, self.staging, group)
        self.graphs = (
            DecodeGraphs(
                forward,
                cache,
                max_num_seqs,
                max_blocks,
                trash_block,
                self.kernels,
                capture_graphs,
                lora_slots=lora_slots,
            )
            if trash_block is not None and forward.graph_safe
            else None
        )
        self.start_seconds = 0.0  # kernel choice and graph capture at start (set by build_cuda_step)
        self.trials: list[choice.Trial] = []  # the measurements behind the kernel choice (idem)

    def capture_graphs(self) -> float:
        """Capture every decode graph that can be captured up front; returns the seconds it took."""
        return self.graphs.capture_all() if self.graphs is not None else 0.0

    def logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits of the sampling rows; inputs are built on the host."""
        return self.run(inputs).logits

    def run(
        self,
        inputs: StepInputs,
        before_forward: Callable[[torch.Tensor], None] | None = None,
        lora_meta: np.ndarray | None = None,
    ) -> StepLogits:
        """`before_forward`: called with the device's input ids once the inputs' copies are queued, before
        the forward (the runner fills async scheduling's placeholder tokens there). `lora_meta`: the rows
        under each adapter slot (gpu/lora/slots.py), None when no row has an adapter."""
        self.staging.begin_step()  # a pinned slot whose last copies have run (gpu/cuda/staging.py)
        try:
            return self._run(inputs, before_forward, lora_meta)
        finally:
            self.staging.end_step()

    def _run(
        self,
        inputs: StepInputs,
        before_forward: Callable[[torch.Tensor], None] | None,
        lora_meta: np.ndarray | None = None,
    ) -> StepLogits:
        tables = self.tables.apply(inputs.table_updates, self.staging)  # first: what any step reads
        meta = inputs.attention
        rows = inputs.input_ids.numel()
        if self.graphs is not None and meta.num_decodes == rows == len(inputs.sample_chunks):
            blocks = -(-meta.max_decode_len // self.cache.shape.block_size)
            if self.graphs.covers(rows, blocks):
                out: DecodeOutput = self.graphs.run(
                    self.staging,
                    inputs.input_ids.numpy(),
                    inputs.positions.numpy(),
                    inputs.slots.numpy(),
                    meta.decode_lens.numpy(),
                    tables,
                    meta.decode_seats.numpy(),
                    blocks,
                    before_forward=before_forward,
                    lora_meta=lora_meta,
                )
                return StepLogits(out.logits, out.greedy)
        staged = self._to_device(inputs, tables)
        if before_forward is not None:
            before_forward(staged.input_ids)
        lora = None
        if lora_meta is not None:
            assert self.lora_slots is not None
            meta = self.staging.to_device("lora_meta", torch.from_numpy(lora_meta))
            lora = SlotLora(self.lora_slots, meta, rows, self.lora_kernels)
        return StepLogits(self.forward(staged, self.cache, self.attention, lora), None)

    def _to_device(self, inputs: StepInputs, tables: torch.Tensor) -> StepInputs:
        stage = self.staging.to_device
        meta = inputs.attention
        attention = dataclasses.replace(
            meta,
            block_tables=tables,
            decode_rows=stage("decode_rows", meta.decode_rows),
            decode_seats=stage("decode_seats", meta.decode_seats),
            decode_lens=stage("decode_lens", meta.decode_lens),
        )
        return dataclasses.replace(
            inputs,
            input_ids=stage("ids", inputs.input_ids),
            positions=stage("positions", inputs.positions),
            slots=stage("slots", inputs.slots),
            attention=attention,
            sample_rows=stage("sample_rows", inputs.sample_rows),
        )


def build_cuda_step(
    forward: LlamaForward,
    cache: KVCache,
    max_num_seqs: int,
    max_blocks: int,
    trash_block: int,
    kernels: CudaKernels | None = None,
    capture_graphs: bool = True,
    lora_slots: StackedSlots | None = None,
) -> CudaStep:
    """The engine-start sequence on CUDA: kernels measured (unless given), graphs captured, both logged."""
    start = time.perf_counter()
    trials: list[choice.Trial] = []
    if kernels is None:
        kernels, trials = choice.choose(forward, cache.shape, max_num_seqs, max_blocks)
        choice.log_choice(kernels, trials)
    chosen = time.perf_counter()
    step = CudaStep(
        forward, cache, max_num_seqs, max_blocks, trash_block, capture_graphs, kernels, lora_slots
    )
    captured = step.capture_graphs()
    step.start_seconds, step.trials = time.perf_counter() - start, trials
    graphs = len(step.graphs._graphs) if step.graphs is not None else 0
    log.info(
        "CUDA step ready in %.2f s: kernels measured in %.2f s, %d decode graphs captured in %.2f s",
        step.start_seconds,
        chosen - start,
        graphs,
        captured,
    )
    return step
