"""Kernel choices by measurement, and the C kernel's build cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu.cpu import autotune
from gpu.cpu.linear import UNBOUNDED, Linear
from gpu.cpu.native import build
from gpu.cpu.native_decode import NativeDecode
from gpu.cpu.panel_linear import PanelKernel
from gpu.cpu.rope_write import RopeCacheWrite
from gpu.forward import rotate
from gpu.kv_cache import KVCache, KVShape


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


def test_linear_choice_is_measured_among_kernels_that_agree():
    choice = autotune.linear_choice(96, 64, torch.float32, 64, torch.get_num_threads())
    linear = Linear(torch.randn(96, 64), torch.randn(96))
    assert choice[-1][0] == UNBOUNDED and [b for b, _ in choice] == sorted(b for b, _ in choice)
    assert {kernel for _, kernel in choice} <= set(linear.kernels)
    for rows in (1, 5, 16, 33):
        x = torch.randn(rows, 64)
        for kernel in linear.kernels:
            torch.testing.assert_close(linear.run(kernel, x), linear.plain(x), rtol=1e-5, atol=1e-5)


def test_panel_kernel_matches_plain_for_ragged_shapes_strided_rows_and_bias():
    kernel = PanelKernel.load()
    if kernel is None:
        pytest.skip("no C compiler or no AVX2 here")
    g = torch.Generator().manual_seed(3)
    for out_features, in_features, rows in [(37, 19, 1), (16, 8, 6), (33, 70, 7), (200, 96, 97), (5, 3, 13)]:
        weight = torch.randn(out_features, in_features, generator=g)
        bias = torch.randn(out_features, generator=g)
        wide = torch.randn(rows, in_features + 5, generator=g)
        x = wide[:, 2 : 2 + in_features]  # rows strided, each row dense
        packed = kernel.pack(weight)
        for b in (None, bias):
            torch.testing.assert_close(kernel(x, packed, out_features, b), F.linear(x, weight, b))
    empty = kernel(torch.empty(0, 8), kernel.pack(torch.randn(4, 8)), 4, None)
    assert empty.shape == (0, 4)


def test_kernel_build_falls_back_without_a_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert build.load.__wrapped__("paged_attention", cache_dir=tmp_path) is None


def test_kernel_build_is_cached_by_source_and_cpu(tmp_path):
    if build._compiler() is None:
        pytest.skip("no C compiler here; the fallback is tested above")
    first = build.load.__wrapped__("paged_attention", cache_dir=tmp_path)
    assert first is not None and first.inferq_abi_version() == 2
    built = sorted(tmp_path.glob("paged_attention-*.so"))
    assert len(built) == 1
    build.load.__wrapped__("paged_attention", cache_dir=tmp_path)  # second load: the same file, no rebuild
    assert sorted(tmp_path.glob("*.so")) == built


def test_choice_ranges_end_halfway_between_measured_sizes():
    winners = [(1, "plain"), (4, "panel"), (16, "panel"), (64, "packed"), (256, "plain"), (512, "plain")]
    expected = ((2, "plain"), (32, "panel"), (128, "packed"), (UNBOUNDED, "plain"))
    assert autotune.choice_from(winners) == expected
    assert autotune.choice_from([(1, "panel")]) == ((UNBOUNDED, "panel"),)


def test_linear_runs_the_kernel_its_choice_names_for_each_row_count():
    linear = Linear(torch.randn(32, 16), None)
    calls = []
    for name in ("plain", "packed", "panel"):
        setattr(linear, name, lambda x, name=name: calls.append(name) or x)
    linear.choice = ((2, "plain"), (64, "packed"), (UNBOUNDED, "panel"))
    for rows in (1, 2, 63, 64, 5000):
        linear(torch.zeros(rows, 16))
    assert calls == ["plain", "packed", "packed", "panel", "panel"]


def test_use_drops_the_layouts_no_row_count_uses():
    linear = Linear(torch.randn(32, 16), None)
    linear.use(((8, "plain"), (UNBOUNDED, "panel")))
    assert linear.packed_weight is None
    assert linear.choice[-1] == (UNBOUNDED, "panel" if "panel" in linear.kernels else "plain")
    linear.use(Linear.ALWAYS_PLAIN)
    assert linear.panel_weight is None and linear.kernels == ("plain",)
    x = torch.randn(9, 16)
    torch.testing.assert_close(linear(x), x @ linear.weight.T)


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
