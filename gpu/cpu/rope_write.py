"""RoPE of the new q/k rows and their K/V cache write in one native pass (gpu/cpu/native/rope_cache.c).

The torch path (gpu/forward.py `rotate` + `KVCache.write`) stays the reference and the fallback: on
CUDA, for other dtypes, and wherever the kernel cannot be built or does not agree bit for bit (checked
once at engine start by gpu/cpu/autotune.py, which also keeps it only where it is faster).
"""

from __future__ import annotations

import ctypes

import torch

from gpu.cpu.native import build
from gpu.kv_cache import KVCache

_ABI_VERSION = 1
MAX_HEAD_DIM = 1024  # the kernel's stack buffer holds half a row
# Separate roundings for each product and the sum, as torch's operators round: results equal torch's bits.
EXTRA_FLAGS = ("-ffp-contract=off",)


class RopeCacheWrite:
    """Callable for float32 CPU tensors; construct with `RopeCacheWrite.load()` (None where unavailable)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._kernel = build.function(library, "rope_cache_write_f32", "pipippppppiiiii")

    @classmethod
    def load(cls) -> RopeCacheWrite | None:
        library = build.load_versioned("rope_cache", "inferq_rope_abi_version", _ABI_VERSION, EXTRA_FLAGS)
        return None if library is None else cls(library)

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
        return (
            device.type == "cpu" and dtype == torch.float32 and head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0
        )

    def __call__(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        layer: int,
        slots: torch.Tensor,
    ) -> None:
        """Rotate qk [T, heads + kv_heads, D] in place with the cos/sin tables [max_positions, D] at
        `positions`, then store its k rows and v [T, kv_heads, D] at `slots` of the layer's cache."""
        tokens, rows, dim = qk.shape
        kv_heads = v.shape[1]
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        assert qk.stride(2) == 1 and qk.stride(1) == dim and v.stride(2) == 1 and v.stride(1) == dim
        assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[1] == dim
        assert (
            positions.dtype == slots.dtype == torch.int64
            and positions.is_contiguous()
            and slots.is_contiguous()
        )
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        self._kernel(
            qk.data_ptr(),
            qk.stride(0),
            v.data_ptr(),
            v.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tokens,
            rows - kv_heads,
            kv_heads,
            dim,
            k_cache.shape[1] * k_cache.shape[2],
        )
