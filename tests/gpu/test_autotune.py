"""Kernel choices by measurement, and the C kernel's build cache."""

from __future__ import annotations

import pytest
import torch

from gpu import autotune
from gpu.attention.native_decode import NativeDecode
from gpu.forward import rotate
from gpu.kv_cache import KVCache, KVShape
from gpu.linear import Linear
from gpu.native import build
from gpu.rope_cache import RopeCacheWrite


def test_race_times_every_candidate():
    calls = {"a": 0, "b": 0}

    def bump(name):
        calls[name] += 1

    times = autotune.race({"a": lambda: bump("a"), "b": lambda: bump("b")}, reps=3)
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    assert calls == {"a": 4, "b": 4}  # one warm-up each, then the timed calls


def test_decode_kernel_choice_is_a_kernel_that_runs_here():
    shape = KVShape(1, 2, 16, 4, torch.float32)
    choice = autotune.decode_kernel(shape, 4, 8, 40, torch.get_num_threads())
    assert choice in ("native", "torch")
    if NativeDecode.load() is None:
        assert choice == "torch"
    bf16 = KVShape(1, 2, 16, 4, torch.bfloat16)  # the C kernel is float32 only
    assert autotune.decode_kernel(bf16, 4, 8, 40, torch.get_num_threads()) == "torch"


def test_linear_packed_range_is_measured_and_results_agree():
    low, high = autotune.packed_rows(96, 64, torch.float32, 64, torch.get_num_threads())
    assert (low, high) == Linear.NEVER or 0 <= low < high
    linear = Linear(torch.randn(96, 64), torch.randn(96))
    x = torch.randn(16, 64)
    if linear.packed_weight is not None:
        torch.testing.assert_close(linear.packed(x), linear.plain(x), rtol=1e-5, atol=1e-5)


def test_kernel_build_falls_back_without_a_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert build.load.__wrapped__("paged_attention", cache_dir=tmp_path) is None


def test_kernel_build_is_cached_by_source_and_cpu(tmp_path):
    if build._compiler() is None:
        pytest.skip("no C compiler here; the fallback is tested above")
    first = build.load.__wrapped__("paged_attention", cache_dir=tmp_path)
    assert first is not None and first.inferq_abi_version() == 1
    built = sorted(tmp_path.glob("paged_attention-*.so"))
    assert len(built) == 1
    build.load.__wrapped__("paged_attention", cache_dir=tmp_path)  # second load: the same file, no rebuild
    assert sorted(tmp_path.glob("*.so")) == built


def test_packed_range_covers_the_sizes_where_packed_wins():
    # SmolLM2's qkv here: packed wins for decode batches, loses at one row and for prefill-sized batches
    timed = [
        (1, 1.0, 1.1),
        (4, 1.9, 1.1),
        (16, 3.0, 2.1),
        (64, 5.9, 5.1),
        (256, 19.4, 19.0),
        (512, 33.0, 34.8),
    ]
    assert autotune.packed_range(timed) == (2, 363)  # halfway (geometrically) to 1 and to 512 rows
    # packed wins from 16 rows on: the range is open above
    assert autotune.packed_range([(4, 1.0, 1.2), (16, 2.0, 1.5), (64, 3.0, 2.0)]) == (8, 1 << 62)
    # one noisy size splits the run; the run saving the most wins
    timed = [(4, 1.0, 0.9), (16, 2.0, 1.0), (64, 3.0, 3.1), (256, 9.0, 8.9)]
    assert autotune.packed_range(timed) == (0, 32)
    # plain wins at every size: never packed
    assert autotune.packed_range([(4, 1.0, 1.1), (64, 2.0, 2.5)]) == Linear.NEVER


def test_linear_uses_the_packed_kernel_only_inside_its_range():
    linear = Linear(torch.randn(32, 16), None)
    if linear.packed_weight is None:
        pytest.skip("no oneDNN here")
    calls = []
    linear.plain = lambda x: calls.append("plain") or x  # type: ignore[method-assign]
    linear.packed = lambda x: calls.append("packed") or x  # type: ignore[method-assign]
    linear.packed_rows = (2, 64)
    for rows in (1, 2, 63, 64):
        linear(torch.zeros(rows, 16))
    assert calls == ["plain", "packed", "packed", "plain"]


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, tokens", [(9, 3, 64, 47), (4, 4, 16, 1), (8, 2, 32, 300)]
)
def test_fused_rope_write_equals_the_torch_path_bit_for_bit(heads, kv_heads, head_dim, tokens):
    fused = RopeCacheWrite.load()
    if fused is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(tokens)
    shape = KVShape(2, kv_heads, head_dim, 4, torch.float32)
    num_blocks = tokens
    torch_cache, native_cache = (KVCache(shape, num_blocks, torch.device("cpu")) for _ in range(2))
    positions = torch.randint(0, 512, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * shape.block_size, generator=g)[:tokens]
    angles = torch.rand(512, head_dim, generator=g) * 6.3
    cos, sin = angles.cos(), angles.sin()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    qk, v = qkv.split(((heads + kv_heads) * head_dim, kv_heads * head_dim), dim=-1)
    qk, v = qk.view(tokens, heads + kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)

    expected = rotate(qk, cos[positions][:, None], sin[positions][:, None])
    torch_cache.write(1, slots, expected[:, heads:], v)
    fused(qk, v, positions, cos, sin, native_cache, 1, slots)  # qk rotated in place

    assert torch.equal(qk, expected)
    assert torch.equal(native_cache.k, torch_cache.k) and torch.equal(native_cache.v, torch_cache.v)


def test_fused_rope_write_choice_is_measured_and_checked():
    choice = autotune.rope_write_kernel(9, 3, 64, 16, torch.get_num_threads())
    assert choice in (True, False)
    if RopeCacheWrite.load() is None:
        assert choice is False
