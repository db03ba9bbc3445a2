"""Linear layers with up to three kernels per weight, the one used chosen by the batch's row count.

At this project's shapes (hidden 256-576, 1-1024 rows) `F.linear` runs far below the CPU's peak. Two
other layouts of the same weight, each prepared once, can be faster:
- "packed": oneDNN with the weight reordered into its blocked layout (1.5-3x faster for decode batches on
  the issue-3 machine; see shared/notes/cpu-forward.md);
- "panel": this project's AVX2 kernel over 16-column panels (gpu/cpu/panel_linear.py), 1.3-2x faster than
  the best of the other two for 8-64 rows on the issue-10 machine.
Which kernel wins depends on the CPU, the shape, the row count and the thread count, so the choice is
measured per shape at engine start (gpu/cpu/autotune.py); layouts no row count uses are then dropped.
Results agree to rounding (each kernel sums in its own order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.cpu.panel_linear import PanelKernel

PACK_BATCH_HINT = 64  # rows the oneDNN layout is tuned for (a full decode batch)
UNBOUNDED = 1 << 62
# (below this many rows, use this kernel), ascending: the choice until measured, among those available
DEFAULT_CHOICE = ((8, "plain"), (UNBOUNDED, "panel"), (UNBOUNDED, "packed"))

Choice = tuple[tuple[int, str], ...]


def _packing_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    ALWAYS_PLAIN: Choice = ((UNBOUNDED, "plain"),)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool = True) -> None:
        """`packed=False` keeps only the plain kernel."""
        self.weight = weight.contiguous()
        self.bias = bias.contiguous() if bias is not None else None
        self.out_features = weight.shape[0]
        self.packed_weight: torch.Tensor | None = None
        self.panel_weight: torch.Tensor | None = None
        self._panel: PanelKernel | None = None
        if packed and _packing_available(weight):
            try:
                self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_BATCH_HINT)
            except RuntimeError:  # e.g. bfloat16 on a CPU whose oneDNN build lacks it: stay plain
                self.packed_weight = None
        if packed and PanelKernel.supports(weight):
            self._panel = PanelKernel.load()
            if self._panel is not None:
                self.panel_weight = self._panel.pack(self.weight)
        self.choice: Choice = self._usable(DEFAULT_CHOICE)

    @property
    def kernels(self) -> tuple[str, ...]:
        """The kernels this weight can run here."""
        layouts = {"plain": self.weight, "packed": self.packed_weight, "panel": self.panel_weight}
        return tuple(name for name, layout in layouts.items() if layout is not None)

    def _usable(self, choice: Choice) -> Choice:
        kept = tuple((below, kernel) for below, kernel in choice if kernel in self.kernels)
        return kept if kept and kept[-1][0] == UNBOUNDED else (*kept, (UNBOUNDED, "plain"))

    def use(self, choice: Choice) -> None:
        """Adopt a measured choice and free the layouts it never uses."""
        self.choice = self._usable(choice)
        used = {kernel for _, kernel in self.choice}
        if "packed" not in used:
            self.packed_weight = None
        if "panel" not in used:
            self.panel_weight = None

    def kernel_for(self, rows: int) -> str:
        for below, kernel in self.choice:
            if rows < below:
                return kernel
        return "plain"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.kernel_for(x.shape[0]), x)

    def run(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel == "panel":
            return self.panel(x)
        if kernel == "packed":
            return self.packed(x)
        return self.plain(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        assert self.packed_weight is not None
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def panel(self, x: torch.Tensor) -> torch.Tensor:
        assert self._panel is not None and self.panel_weight is not None
        return self._panel(x, self.panel_weight, self.out_features, self.bias)
