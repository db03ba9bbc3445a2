"""The CPU KV cache: zeroed, on huge-page boundaries, alive as long as its tensors."""

from __future__ import annotations

import gc

import pytest
import torch

from gpu.kv_cache import HUGE_PAGE, KVCache, KVShape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_cache_is_zeroed_aligned_and_outlives_its_owner(dtype):
    cache = KVCache(KVShape(2, 2, 16, 4, dtype), 10, torch.device("cpu"))
    assert cache.k.shape == (2, 2, 10, 4, 16) and cache.k.dtype == dtype and cache.k.is_contiguous()
    assert cache.k.data_ptr() % HUGE_PAGE == 0 and cache.v.data_ptr() % HUGE_PAGE == 0
    assert not cache.k.any() and not cache.v.any()
    k = cache.k
    del cache
    gc.collect()
    k += 1  # the mapping is still there: the tensor holds it
    assert float(k.float().sum()) == k.numel()
