"""Attention over the paged KV cache for a mixed step, behind one interface.

`PagedAttention(decode=...)`: decode rows (one-token chunks) through the chosen decode kernel, prefill
chunks through SDPA. CPU decode kernels: "native" (C, reads blocks in place; float32) and "torch"
(bucketed gather + batched products; any dtype and device). Which one runs is measured at engine start
(gpu/cpu/autotune.py); CUDA has its own backend in gpu/cuda/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gpu.attention.metadata import AttentionMetadata
from gpu.attention.prefill import PrefillPlan, plan_for, prefill_all
from gpu.attention.torch_decode import Bucket, DecodeScratch, decode_bucket, plan_buckets
from gpu.kv_cache import KVCache

if TYPE_CHECKING:  # gpu/cpu/native_decode.py imports this package's metadata: no import circle at run time
    from gpu.cpu.native_decode import NativeDecode

DECODE_KINDS = ("native", "torch")


@dataclass(frozen=True)
class StepPlan:
    meta: AttentionMetadata
    buckets: tuple[Bucket, ...]  # the torch decode kernel's context-length buckets (empty for native)
    prefills: tuple[PrefillPlan, ...]


class PagedAttention:
    def __init__(self, decode: str = "torch", native: NativeDecode | None = None) -> None:
        if decode not in DECODE_KINDS:
            raise ValueError(f"unknown decode kernel {decode!r}; choose one of {DECODE_KINDS}")
        if decode == "native" and native is None:
            raise ValueError("the native decode kernel is not available here")
        self.decode = decode
        self._native = native
        self._scratch = DecodeScratch()

    def plan(self, meta: AttentionMetadata, cache: KVCache) -> StepPlan:
        """Per-step preparation shared by every layer."""
        block_size = cache.shape.block_size
        buckets = plan_buckets(meta, block_size, cache.shape.dtype) if self.decode == "torch" else ()
        return StepPlan(meta, buckets, plan_for(meta, cache))

    def __call__(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        cache: KVCache,
        layer: int,
        plan: StepPlan,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q [T, heads, D] for every token of the step; k_new/v_new [T, kv_heads, D] are already cached.
        `window`: the layer's sliding window (a query sees itself and the window - 1 keys before it);
        `softcap`: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2)."""
        meta = plan.meta
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            if self._native is not None and self.decode == "native":
                self._native(q, out, cache, layer, meta, scale, window, softcap)
            elif meta.decode_first is not None and len(plan.buckets) == 1:
                rows = slice(meta.decode_first, meta.decode_first + meta.num_decodes)
                out[rows] = decode_bucket(
                    q[rows], cache, layer, plan.buckets[0], scale, self._scratch, window, softcap
                )
            else:
                for bucket in plan.buckets:
                    out[bucket.rows] = decode_bucket(
                        q[bucket.rows], cache, layer, bucket, scale, self._scratch, window, softcap
                    )
        if plan.prefills:
            prefill_all(q, k_new, v_new, cache, layer, plan.prefills, scale, out, window, softcap)
        return out
