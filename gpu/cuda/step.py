"""One model step on CUDA: decode-only steps through captured graphs, everything else eagerly."""

from __future__ import annotations

import dataclasses

import torch

from gpu.cuda.attention import CudaPagedAttention
from gpu.cuda.graphs import DecodeGraphs
from gpu.cuda.staging import PinnedStaging
from gpu.forward import LlamaForward
from gpu.inputs import StepInputs
from gpu.kv_cache import KVCache


class CudaStep:
    def __init__(
        self,
        forward: LlamaForward,
        cache: KVCache,
        max_num_seqs: int,
        max_blocks: int,
        trash_block: int | None,
        capture_graphs: bool = True,
    ) -> None:
        self.forward, self.cache = forward, cache
        self.attention = CudaPagedAttention()
        self.staging = PinnedStaging(cache.k.device)
        self.graphs = (
            DecodeGraphs(forward, cache, max_num_seqs, max_blocks, trash_block, capture_graphs)
            if trash_block is not None and forward.graph_safe
            else None
        )

    def logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits of the sampling rows; inputs are built on the host."""
        meta = inputs.attention
        rows = inputs.input_ids.numel()
        if self.graphs is not None and meta.num_decodes == rows == len(inputs.sample_chunks):
            blocks = -(-meta.max_decode_len // self.cache.shape.block_size)
            if self.graphs.covers(rows, blocks):
                tables = meta.block_tables[meta.decode_seats, :blocks]
                return self.graphs.run(
                    self.staging, inputs.input_ids, inputs.positions, inputs.slots, tables, meta.decode_lens
                )
        return self.forward(self._to_device(inputs), self.cache, self.attention)

    def _to_device(self, inputs: StepInputs) -> StepInputs:
        stage = self.staging.to_device
        meta = inputs.attention
        attention = dataclasses.replace(
            meta,
            block_tables=stage("tables", meta.block_tables),
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
