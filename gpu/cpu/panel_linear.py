"""y = x W^T (+ bias) through the register-blocked AVX2 kernel in gpu/cpu/native/linear.c.

The weight is repacked once into 16-column panels; the kernel runs on torch's OpenMP pool, so the thread
count torch.set_num_threads sets (and gpu/cpu/threads.py chooses) governs it too. Float32 on the CPU only;
whether a shape uses it, and for which row counts, is measured at engine start (gpu/cpu/autotune.py).
"""

from __future__ import annotations

import ctypes

import torch

from gpu.cpu.native import build

_ABI_VERSION = 1
PANEL_COLUMNS = 16


class PanelKernel:
    """Construct with `PanelKernel.load()` (None where the kernel cannot be built or has no SIMD path)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._pack = build.function(library, "linear_pack_f32", "piip")
        self._run = build.function(library, "linear_f32", "piiipipp")

    @classmethod
    def load(cls) -> PanelKernel | None:
        library = build.load_versioned("linear", "inferq_linear_abi_version", _ABI_VERSION)
        if library is None:
            return None
        if not library.linear_has_simd():  # the scalar path is there for correctness, never for speed
            return None
        return cls(library)

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The [out, in] weight as [panels, in, 16] (the last panel zero-padded)."""
        weight = weight.contiguous()
        out_features, in_features = weight.shape
        panels = -(-out_features // PANEL_COLUMNS)
        packed = torch.empty(panels, in_features, PANEL_COLUMNS, dtype=torch.float32)
        self._pack(weight.data_ptr(), out_features, in_features, packed.data_ptr())
        return packed

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [rows, in] float32 (rows may be strided; each row dense) -> [rows, out_features]."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, in_features = x.shape
        assert packed.shape[1] == in_features and x.dtype == torch.float32
        out = torch.empty(rows, out_features, dtype=torch.float32)
        if rows:
            self._run(
                x.data_ptr(),
                x.stride(0),
                rows,
                in_features,
                packed.data_ptr(),
                out_features,
                bias.data_ptr() if bias is not None else None,
                out.data_ptr(),
            )
        return out
