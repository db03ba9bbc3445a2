"""Triton kernels for the CUDA path; each has a torch path in the repo that stays its reference and fallback.

- `decode.py`: paged decode attention (one query per row, GQA, split-K over long contexts, then a reduce);
  replaces `gpu.cuda.attention.decode_attention` (block gather + SDPA; also `gpu.attention.torch_decode`).
- `prefill.py`: varlen paged attention (packed chunks, each causal over its cached prefix and itself, decode
  rows as one-token chunks where the decode kernel does not take them; a tile holds every query head of a
  KV head's group); replaces `gpu.attention.prefill` (one SDPA per chunk over a gathered context).
- `rms_norm.py`: residual add + RMSNorm, returning the normed rows and the new residual; replaces
  `x + delta` then `gpu.forward.rms_norm`.
- `rope_cache.py`: RoPE of q and k in place and the K/V cache write at the step's slots; replaces
  `gpu.forward.rotate` + `KVCache.write` (what the C kernel `gpu.cpu.rope_write` does on the CPU).
- `silu_mul.py`: SiLU(gate) * up over the fused gate/up product; replaces `F.silu(gate) * up`.
- `argmax.py`: greedy argmax of logits rows (first maximum, NaN first, as torch); replaces
  `gpu.sampler.fast_argmax` / `torch.argmax`.

They run only on CUDA tensors and only where triton imports: nothing in `gpu/` imports these modules (or
triton) on a CPU code path, and this package's `__init__` imports neither. Callers check `available()` and
keep the torch path otherwise. Which ones the CUDA step uses is measured at engine start against the torch
paths (gpu/cuda/choice.py). Written against Triton 3.6's language (masked loads and stores, `tl.dot`,
constexpr tile sizes); verified on the CPU with TRITON_INTERPRET=1 (tests/gpu/test_triton_kernels.py,
and the whole CUDA step in tests/gpu/test_cuda_triton_step.py), and compiled ahead of time for sm_90 and
sm_80 by Triton 3.6 at the served models' shapes, registers and shared memory checked against the
hardware's limits (tests/gpu/test_triton_aot.py); not yet run on a GPU since.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def importable() -> bool:
    """Whether triton imports here (imported once, on the first call, never at package import)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install (missing libcuda bindings, version clash) means "no triton"
        return False
    return True


def available(device_type: str) -> bool:
    """Whether the kernels can serve tensors of this device type: CUDA with triton importable.

    (Tests also run them on CPU tensors under TRITON_INTERPRET=1; serving never does.)"""
    return device_type == "cuda" and importable()


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
