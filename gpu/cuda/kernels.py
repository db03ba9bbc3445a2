"""Which kernels the CUDA step runs: the Triton ones (gpu/triton_kernels/) or the torch paths they replace
(chosen by measurement at engine start in gpu/cuda/choice.py), and installing them into the forward."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gpu.forward import LlamaForward


@dataclass(frozen=True)
class CudaKernels:
    """True: the Triton kernel; False: the torch path."""

    decode: bool = False  # paged decode attention over block tables (no gather): graphs keyed by batch only
    varlen: bool = False  # one varlen attention call per layer for prefill and mixed steps
    add_rms_norm: bool = False
    rope_write: bool = False
    silu_mul: bool = False
    argmax: bool = False  # greedy argmax inside the decode graph

    @classmethod
    def torch_only(cls) -> CudaKernels:
        return cls()

    @classmethod
    def all_triton(cls) -> CudaKernels:
        return cls(*(True for _ in dataclasses.fields(cls)))

    def describe(self) -> str:
        names = (f.name for f in dataclasses.fields(self))
        return ", ".join(f"{n}={'triton' if getattr(self, n) else 'torch'}" for n in names)


def install(forward: LlamaForward, kernels: CudaKernels) -> None:
    """Point the forward's fused hooks at the chosen Triton kernels (imported only here)."""
    if kernels.add_rms_norm:
        from gpu.triton_kernels.rms_norm import add_rms_norm

        forward.add_rms_norm = add_rms_norm
    if kernels.silu_mul and forward.silu:
        from gpu.triton_kernels.silu_mul import silu_mul

        forward.silu_mul = silu_mul
    if kernels.rope_write and forward.graph_safe:
        from gpu.triton_kernels.rope_cache import TritonRopeCacheWrite

        # Positions and slots come from the scheduler and the graphs' padding: in range by construction,
        # and a bounds check would read device memory on the host (no graph could hold it).
        forward.rope_write, forward.rope_write_checked = TritonRopeCacheWrite(), False
