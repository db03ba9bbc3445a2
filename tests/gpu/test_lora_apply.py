"""The CPU's LoRA (gpu/lora/rows.py): the native kernel and the torch path (two matmuls per adapter)
against a per-row reference, on scattered and consecutive rows, ranks that are not a multiple of the
kernel's 16 columns, row blocks short of 4, adapters that leave a product alone, and a fused q|k|v."""

from __future__ import annotations

import pytest
import torch

from gpu.engine_types import LoraRequest
from gpu.lora.adapter import TARGETS
from gpu.lora.manager import LoraManager
from gpu.lora.native import NativeLora
from gpu.lora.rows import CpuLora, lora_rows
from tests.gpu.factories import make_model
from tests.gpu.lora_factories import make_adapter

KERNELS = [
    pytest.param("native", marks=pytest.mark.skipif(NativeLora.load() is None, reason="no C compiler")),
    "torch",
]


def _reference(adapters, layer, target, x, out):
    want = out.clone()
    for row, adapter in enumerate(adapters):
        w = adapter.weights.get((layer, target)) if adapter is not None else None
        if w is not None:
            want[row] += (x[row] @ w.a_t) @ w.b_t
    return want


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", ["scattered", "runs"])
def test_each_row_gets_its_own_adapters_delta(tmp_path, kernel, layout):
    model = make_model()
    manager = LoraManager(model, 3, 16)
    made = [
        make_adapter(model, tmp_path, "all", 1, r=5),  # ranks summed per product: 15, 5, 10, 5
        make_adapter(model, tmp_path, "qv", 2, r=16, targets=("q_proj", "v_proj")),
        make_adapter(
            model, tmp_path, "patterns", 3, r=3, rank_pattern={"up_proj": 9}, layers_to_transform=[1]
        ),
    ]
    adapters = [manager.load(lora) for lora, _ in made]
    if layout == "runs":
        per_row = [adapters[0]] * 5 + [None] * 2 + [adapters[1]] * 3 + [adapters[2]] * 7
    else:
        per_row = [adapters[i % 4] if i % 4 < 3 else None for i in range(17)]
    rows = lora_rows(per_row)
    assert rows is not None and rows.runs == (layout == "runs")
    apply = CpuLora(rows, manager.native if kernel == "native" else None)
    assert (apply.native is not None) == (kernel == "native")
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        for target in TARGETS:
            x = torch.randn(len(per_row), manager.targets.in_features(target), generator=g)
            out = torch.randn(len(per_row), manager.targets.out_features(target), generator=g)
            want = _reference(per_row, layer, target, x, out)
            apply(layer, target, x, out)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_a_step_without_adapter_rows_has_no_lora_work():
    assert lora_rows([None, None, None]) is None
    assert lora_rows([]) is None


def test_the_host_cache_keys_by_name_and_path_and_keeps_what_requests_hold(tmp_path):
    model = make_model()
    manager = LoraManager(model, 2, 16, max_cpu_loras=2)
    old, _ = make_adapter(model, tmp_path / "v1", "a", 1)
    new = LoraRequest("a", make_adapter(model, tmp_path / "v2", "a", 2)[0].path)  # re-registered elsewhere
    other, _ = make_adapter(model, tmp_path, "b", 3)
    held = manager.hold(old)
    fresh = manager.load(new)
    assert fresh is not manager.load(old)  # another directory: another adapter, loaded from it
    assert not torch.equal(fresh.weights[0, "qkv"].a_t, manager.load(old).weights[0, "qkv"].a_t)
    manager.load(other)  # over capacity: the least recently used one no request holds leaves
    assert (old.name, old.path) in manager.host and (new.name, new.path) not in manager.host
    manager.release(held)
    manager.load(new)
    assert (old.name, old.path) not in manager.host and len(manager.host) == 2
