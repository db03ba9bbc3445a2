"""The grammar mask applied on the CPU by a native kernel (gpu/cpu/native/token_mask.c), a word at a time.

xgrammar's CPU kernel tests each token's bit: ~2 ms a step for 16 rows of a 49k vocabulary at structural
positions, where nearly every token is forbidden. This one decides 32 tokens per bitmask word (all allowed:
skip, none: store -inf), ~30x faster there and as fast where nearly all are allowed. xgrammar's kernel stays
the reference (the tests compare them) and the fallback: for CUDA, other dtypes, and where no C compiler is.
"""

from __future__ import annotations

import ctypes

import torch

from gpu.cpu.native import build

_ABI_VERSION = 1


class NativeMask:
    """Callable for float32 CPU logits; construct with `NativeMask.load()` (None where unavailable)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._kernel = build.function(library, "apply_token_bitmask_f32", "pipipii")

    @classmethod
    def load(cls) -> NativeMask | None:
        library = build.load_versioned("token_mask", "inferq_token_mask_abi_version", _ABI_VERSION)
        return None if library is None else cls(library)

    @staticmethod
    def supports(logits: torch.Tensor) -> bool:
        return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1

    def __call__(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
        """Set to -inf, in rows of logits [S, V], each token below vocab_size whose bit in the bitmask row
        of the same index (int32 [>= S, words]) is clear."""
        assert (
            bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.shape[0] >= logits.shape[0]
        )
        assert min(rows) >= 0 and max(rows) < logits.shape[0]
        index = torch.tensor(rows, dtype=torch.int64)
        vocab = min(vocab_size, logits.shape[-1], 32 * bitmask.shape[1])
        self._kernel(
            logits.data_ptr(),
            logits.stride(0),
            bitmask.data_ptr(),
            bitmask.shape[1],
            index.data_ptr(),
            len(rows),
            vocab,
        )
