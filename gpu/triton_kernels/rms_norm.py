"""Residual add + RMSNorm in one pass over each row: the Llama block's `x = x + delta; h = rms_norm(x)`.

Rounding as the reference (gpu.forward.rms_norm, after a torch add in the model's dtype): the sum is
rounded to the model's dtype (that is the residual kept), normalised in float32, rounded to the model's
dtype, then scaled by the weight with one more rounding. The float32 sums differ from torch's only in
summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.triton_kernels import next_pow2


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    delta_ptr,
    weight_ptr,
    out_ptr,
    residual_ptr,
    stride_x,
    stride_delta,
    stride_out,
    stride_residual,
    eps,
    N: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(delta_ptr + row * stride_delta + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(residual_ptr.dtype.element_ty)  # the residual stream is kept in the model's dtype
        tl.store(residual_ptr + row * stride_residual + offs, x, mask=mask)
        x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + delta) * weight, x + delta) for rows x, delta [T, N]; delta None: (rms_norm(x), x).

    One row per program: N up to a few thousand fits in registers (Llama-70B's 8192 included)."""
    tokens, n = x.shape
    assert x.stride(1) == 1 and weight.shape == (n,) and weight.is_contiguous()
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if delta is None:
        residual = x
    else:
        assert delta.shape == x.shape and delta.stride(1) == 1 and delta.dtype == x.dtype
        residual = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out, residual
    block = next_pow2(n)
    _add_rms_norm_kernel[(tokens,)](
        x,
        delta if delta is not None else x,
        weight,
        out,
        residual,
        x.stride(0),
        delta.stride(0) if delta is not None else 0,
        out.stride(0),
        residual.stride(0),
        eps,
        N=n,
        HAS_DELTA=delta is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, residual
