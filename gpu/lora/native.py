"""The C kernel that applies a step's LoRA on the CPU (gpu/cpu/native/lora.c): every adapter of one
product in one call, weights read in place, float32 only. Each adapter carries a table of its products'
pointers and part layout, made once when it is loaded; a step stacks its adapters' tables."""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np
import torch

from gpu.cpu.native import build
from gpu.lora.adapter import TARGETS, LoraAdapter, ModelTargets

_ABI_VERSION = 1
FIELDS = 16  # int64 per table row (lora.c)
MAX_R = 1024
MAX_PARTS = 3
TARGET_INDEX = {target: i for i, target in enumerate(TARGETS)}


class NativeLora:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._apply = build.function(library, "lora_apply_f32", "ipppiipipi", ctypes.c_int)

    @classmethod
    @cache
    def load(cls) -> NativeLora | None:
        library = build.load_versioned("lora", "inferq_lora_abi_version", _ABI_VERSION)
        return None if library is None else cls(library)

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device) -> bool:
        return dtype == torch.float32 and device.type == "cpu"

    def __call__(
        self,
        groups: int,
        starts: np.ndarray,
        rows: np.ndarray,
        table: int,
        x: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        assert x.stride(1) == 1 and out.stride(1) == 1 and x.dtype == out.dtype == torch.float32
        code = self._apply(
            groups, starts.ctypes.data, rows.ctypes.data, table, x.shape[1], out.shape[1],
            x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
        )  # fmt: skip
        if code:
            raise ValueError("an adapter's layout is over the native LoRA kernel's limits")


def adapter_table(adapter: LoraAdapter, targets: ModelTargets) -> np.ndarray | None:
    """[layers * len(TARGETS), FIELDS] int64: per product its a_t and b_t pointers, R, and each part's
    rank rows and output columns (zeros: not adapted). None when a product is past the kernel's limits."""
    table = np.zeros((targets.num_layers * len(TARGETS), FIELDS), dtype=np.int64)
    for (layer, target), w in adapter.weights.items():
        r = w.a_t.shape[1]
        if r > MAX_R or len(w.parts) > MAX_PARTS or not (w.a_t.is_contiguous() and w.b_t.is_contiguous()):
            return None
        row = table[layer * len(TARGETS) + TARGET_INDEX[target]]
        row[:4] = (w.a_t.data_ptr(), w.b_t.data_ptr(), r, len(w.parts))
        for i, (part, first, rank) in enumerate(w.parts):
            spec = targets.parts[target][part]
            row[4 + 4 * i : 8 + 4 * i] = (first, rank, spec.offset, spec.out_features)
    return table
