"""Device slots: up to max_loras adapters resident in stacked, rank-padded weights, one static layout.

Per layer and product: A as [max_loras, P * max_lora_rank, in] and B as [max_loras, out, P * max_lora_rank]
(P: the product's parts, 3 for Llama's q|k|v), each part's matrices in its own rank block, zeros where an
adapter has a smaller rank or does not adapt the part. Every step's kernels (and the CUDA graphs that hold
them) see these very tensors; an adapter comes into a slot by copies in place, between steps.

A step says which rows run under which slot with one int64 vector, `meta`: [start by slot (max_loras),
row count by slot (max_loras), rows grouped by slot (n)] (Punica's SGMV segments); base rows are in no
slot. The shrink and expand kernels read it on the device (gpu/triton_kernels/lora.py); the torch
reference here reads it on the host, which is how the layout is tested on the CPU.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from gpu.lora.adapter import TARGETS, LoraAdapter, ModelTargets
from gpu.lora.rows import LoraRows

log = logging.getLogger(__name__)


class StackedSlots:
    def __init__(
        self, targets: ModelTargets, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(targets.num_layers):
            for target in TARGETS:
                width = len(targets.parts[target]) * max_rank
                shape_a = (max_loras, width, targets.in_features(target))
                shape_b = (max_loras, targets.out_features(target), width)
                self.a[layer, target] = torch.zeros(shape_a, dtype=dtype, device=device)
                self.b[layer, target] = torch.zeros(shape_b, dtype=dtype, device=device)
        self._resident: OrderedDict[tuple[str, str], int] = OrderedDict()  # adapter key -> slot, LRU first
        self.swaps = 0  # adapters copied into a slot since start

    def assign(self, rows: LoraRows) -> np.ndarray:
        """Make the step's adapters resident (the least recently used slots the step does not need
        taken over) and return its `meta` vector. The step may hold at most max_loras adapters."""
        adapters = rows.adapters
        if len(adapters) > self.max_loras:
            raise ValueError(f"a step with {len(adapters)} adapters; the engine holds {self.max_loras}")
        needed = {a.key for a in adapters}
        free = [s for s in range(self.max_loras) if s not in self._resident.values()]
        slots = []
        for adapter in adapters:
            slot = self._resident.get(adapter.key)
            if slot is None:
                if free:
                    slot = free.pop(0)
                else:
                    victim = next(k for k in self._resident if k not in needed)
                    slot = self._resident.pop(victim)
                self._write(slot, adapter)
                self._resident[adapter.key] = slot
            self._resident.move_to_end(adapter.key)
            slots.append(slot)
        meta = np.zeros(2 * self.max_loras + len(rows.rows), dtype=np.int64)
        for slot, start, end in zip(slots, rows.starts, rows.starts[1:], strict=False):
            meta[slot], meta[self.max_loras + slot] = start, end - start
        meta[2 * self.max_loras :] = rows.rows
        return meta

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter into a slot (asynchronous from pinned memory on CUDA: ordered on the stream
        after the steps before, so a step still reading the slot's old weights is not disturbed)."""
        for key, a in self.a.items():
            a[slot].zero_()
            self.b[key][slot].zero_()
        for key, w in adapter.weights.items():
            a, b = self.a[key][slot], self.b[key][slot]
            for part, row, rank in w.parts:
                block = part * self.max_rank
                a[block : block + rank].copy_(w.a_t[:, row : row + rank].t(), non_blocking=True)
                b[:, block : block + rank].copy_(w.b_t[row : row + rank].t(), non_blocking=True)
        self.swaps += 1
        log.debug("LoRA adapter %r into slot %d", adapter.name, slot)

    def resident(self) -> dict[tuple[str, str], int]:
        return dict(self._resident)


class SlotLora:
    """A step's LoRA over the stacked slots: `lora(layer, target, x, out)` adds every adapter row's delta
    to `out` in place. `meta` on the model's device; `max_rows`: the most rows it can name (a decode
    graph's batch, or the step's rows), which sizes the kernels' grids."""

    def __init__(self, slots: StackedSlots, meta: torch.Tensor, max_rows: int, kernels: bool) -> None:
        self.slots, self.meta, self.max_rows = slots, meta, max_rows
        if kernels:
            from gpu.triton_kernels.lora import lora_expand, lora_shrink

            self.shrink, self.expand = lora_shrink, lora_expand
        else:
            self.shrink, self.expand = shrink_reference, expand_reference

    def __call__(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> None:
        key = (layer, target)
        y = self.shrink(x, self.slots.a[key], self.meta, self.max_rows)
        self.expand(y, self.slots.b[key], out, self.meta, self.max_rows)


def shrink_reference(x: torch.Tensor, a: torch.Tensor, meta: torch.Tensor, max_rows: int) -> torch.Tensor:
    """y [max_rows, R] float32: row i of the slot-grouped rows times its slot's A."""
    slots = a.shape[0]
    values = meta.tolist()
    y = torch.zeros(max_rows, a.shape[1], dtype=torch.float32, device=x.device)
    for slot in range(slots):
        start, count = values[slot], values[slots + slot]
        if count:
            rows = meta[2 * slots + start : 2 * slots + start + count]
            y[start : start + count] = x[rows].float() @ a[slot].float().t()
    return y


def expand_reference(
    y: torch.Tensor, b: torch.Tensor, out: torch.Tensor, meta: torch.Tensor, max_rows: int
) -> None:
    """out[row] += y[i] @ B[slot].T for each slot-grouped row i (y rounded to B's dtype first, as the
    kernel feeds its tensor cores)."""
    slots = b.shape[0]
    values = meta.tolist()
    for slot in range(slots):
        start, count = values[slot], values[slots + slot]
        if count:
            rows = meta[2 * slots + start : 2 * slots + start + count]
            delta = y[start : start + count].to(b.dtype).float() @ b[slot].float().t()
            out[rows] += delta.to(out.dtype)
