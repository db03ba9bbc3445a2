"""Which rows of a step run under which adapter, computed once per step and read by every layer; and the
CPU's way of applying them: per adapter, a shrink and an expand as two small matmuls over its rows.

Rows are grouped by adapter (base rows belong to no group and cost nothing). When each adapter's rows are
one run of consecutive rows (a prefill chunk, decodes that happen to sit together) its matmuls read and
write that run in place; otherwise the step's adapter rows are gathered once per product, and the deltas
added back with one indexed add.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu.lora.adapter import TARGETS, LoraAdapter

TARGET_INDEX = {target: i for i, target in enumerate(TARGETS)}


@dataclass(frozen=True)
class LoraRows:
    """A step's adapter rows, grouped by adapter."""

    adapters: tuple[LoraAdapter, ...]  # in order of their first row
    rows: np.ndarray  # int64 [n]: the rows of adapters[0], then adapters[1]'s, ... (ascending within one)
    starts: tuple[int, ...]  # len(adapters) + 1 offsets into rows
    runs: bool  # every adapter's rows are consecutive: rows[starts[i]] .. rows[starts[i + 1] - 1]


def lora_rows(
    adapters: Sequence[LoraAdapter | None], lengths: Sequence[int] | None = None
) -> LoraRows | None:
    """`adapters`: each chunk's adapter (None: the base); `lengths`: each chunk's rows (None: one each).
    None when no row has an adapter."""
    order: dict[tuple[str, str], tuple[LoraAdapter, list[int]]] = {}
    row = 0
    for i, adapter in enumerate(adapters):
        n = 1 if lengths is None else lengths[i]
        if adapter is not None:
            entry = order.get(adapter.key)
            if entry is None:
                entry = order[adapter.key] = (adapter, [])
            entry[1].extend(range(row, row + n))
        row += n
    if not order:
        return None
    groups = list(order.values())
    starts = [0]
    for _, rows in groups:
        starts.append(starts[-1] + len(rows))
    runs = all(rows[-1] - rows[0] == len(rows) - 1 for _, rows in groups)
    flat = np.fromiter((r for _, rows in groups for r in rows), dtype=np.int64, count=starts[-1])
    return LoraRows(tuple(a for a, _ in groups), flat, tuple(starts), runs)


class CpuLora:
    """The step's LoRA on host tensors: `lora(layer, target, x, out)` adds each adapter row's delta to
    `out` (the product's output for x) in place; through the native kernel (one call per product, every
    adapter) where given and every adapter has its table, else two matmuls per adapter."""

    def __init__(self, rows: LoraRows, native: Any = None) -> None:
        self.native = None
        if native is not None and all(a.table is not None for a in rows.adapters):
            self.native = native
            self.groups = len(rows.adapters)
            # [products, adapters, fields]: one product's rows are contiguous, one pointer per call
            self.tables = np.ascontiguousarray(np.stack([a.table for a in rows.adapters], axis=1))
            self.row_bytes = self.groups * self.tables.shape[2] * 8
            self.rows = np.ascontiguousarray(rows.rows)
            self.starts = np.array(rows.starts, dtype=np.int64)
            return
        self.adapters = [a.weights for a in rows.adapters]
        self.bounds = list(zip(rows.starts, rows.starts[1:], strict=False))
        if rows.runs:  # each adapter's rows are one run of the step's rows: slices, nothing gathered
            first = rows.rows
            self.bounds = [(int(first[s]), int(first[s]) + e - s) for s, e in self.bounds]
        self.index = None if rows.runs else torch.from_numpy(rows.rows)

    def __call__(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.native is not None:
            product = layer * len(TARGET_INDEX) + TARGET_INDEX[target]
            table = self.tables.ctypes.data + product * self.row_bytes
            self.native(self.groups, self.starts, self.rows, table, x, out)
            return
        key = (layer, target)
        if self.index is None:
            for weights, (s, e) in zip(self.adapters, self.bounds, strict=True):
                w = weights.get(key)
                if w is not None:
                    out[s:e].addmm_(torch.mm(x[s:e], w.a_t), w.b_t)
            return
        gathered = x.index_select(0, self.index)
        delta = out.new_empty(len(self.index), out.shape[1])
        for weights, (s, e) in zip(self.adapters, self.bounds, strict=True):
            w = weights.get(key)
            if w is None:
                delta[s:e].zero_()
            else:
                torch.mm(torch.mm(gathered[s:e], w.a_t), w.b_t, out=delta[s:e])
        out.index_add_(0, self.index, delta)
