"""SiLU(gate) * up over the fused gate/up product [T, 2I] (gate first), the Llama MLP's activation.

Computed in float32 and rounded once; the reference (`F.silu(gate) * up` in the model's dtype) rounds
after the SiLU too, so half-precision results may differ from it by one unit in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """[T, 2I] -> [T, I]."""
    tokens, double = gate_up.shape
    assert double % 2 == 0 and gate_up.stride(1) == 1
    width = double // 2
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        _silu_mul_kernel[(tokens, triton.cdiv(width, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=block, num_warps=4
        )
    return out
