"""Decode rows through the C kernel in gpu/cpu/native/paged_attention.c: every row reads its own context's
blocks in place, straight from the persistent block tables (no gather copy, no padding, no mask)."""

from __future__ import annotations

import ctypes

import torch

from gpu.attention.metadata import AttentionMetadata
from gpu.cpu.native import build
from gpu.kv_cache import KVCache, KVShape

_ABI_VERSION = 2  # 2: the sliding window and soft-capping arguments
MAX_GROUP = 64  # query heads per KV head the kernel's per-group arrays hold


class NativeDecode:
    """Callable for float32 CPU caches; construct with `NativeDecode.load()` (None where unavailable)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._kernel = build.function(library, "paged_attention_f32", "pipppppppiiiiiiiifif", ctypes.c_int)

    @classmethod
    def load(cls) -> NativeDecode | None:
        library = build.load_versioned("paged_attention", "inferq_abi_version", _ABI_VERSION)
        return None if library is None else cls(library)

    @staticmethod
    def supports(shape: KVShape, device: torch.device, num_heads: int) -> bool:
        group = num_heads // shape.num_kv_heads
        return device.type == "cpu" and shape.dtype == torch.float32 and group <= MAX_GROUP

    def __call__(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        cache: KVCache,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """Attention of the decode rows of q [T, heads, D] into the same rows of out (contiguous).

        q may be a slice of a wider row (e.g. q and k heads side by side): heads and dims must be dense.
        """
        s = cache.shape
        k, v = cache.k[layer], cache.v[layer]
        tables = meta.block_tables
        assert q.stride(2) == 1 and q.stride(1) == q.shape[2] and out.is_contiguous()
        assert k.is_contiguous() and v.is_contiguous() and tables.is_contiguous()
        failed = self._kernel(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            v.data_ptr(),
            out.data_ptr(),
            meta.decode_rows.data_ptr(),
            meta.decode_seats.data_ptr(),
            meta.decode_lens.data_ptr(),
            tables.data_ptr(),
            meta.num_decodes,
            q.shape[1],
            s.num_kv_heads,
            s.head_dim,
            s.block_size,
            k.shape[1],
            tables.shape[1],
            meta.max_decode_len,
            scale,
            window or 0,
            softcap or 0.0,
        )
        if failed:
            raise MemoryError("paged attention kernel: out of memory for its scratch buffers")
