"""Linear layers with weights pre-packed once for oneDNN on CPU, with the plain kernel as fallback.

At this project's shapes (hidden 256, 16-512 rows) `F.linear` runs far below the CPU's peak; oneDNN with a
weight reordered once into its blocked layout was 1.5-3x faster (see shared/notes/cpu-forward.md). For a
single row, and for SmolLM2's prefill-sized batches, the plain kernel was faster, so both are kept, and the
range of row counts in which the packed one is used is measured per shape at engine start
(gpu/autotune.py). Results agree to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 64  # rows the packed layout is tuned for (a full decode batch)
PACKED_ROWS = (8, 1 << 62)  # [from, below): rows that use the packed kernel (a default until measured)


def _packing_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    NEVER = (0, 0)  # packed_rows that keep the plain kernel for every batch

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool = True) -> None:
        self.weight = weight.contiguous()
        self.bias = bias.contiguous() if bias is not None else None
        self.out_features = weight.shape[0]
        self.packed_weight: torch.Tensor | None = None
        self.packed_rows = PACKED_ROWS  # until measured
        if packed and _packing_available(weight):
            try:
                self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_BATCH_HINT)
            except RuntimeError:  # e.g. bfloat16 on a CPU whose oneDNN build lacks it: stay plain
                self.packed_weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        low, high = self.packed_rows
        if self.packed_weight is not None and low <= x.shape[0] < high:
            return self.packed(x)
        return self.plain(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        assert self.packed_weight is not None
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
