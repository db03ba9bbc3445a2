"""The LoRA shrink/expand Triton kernels against their torch references (gpu/lora/slots.py), and the
references against plain per-row matmuls. Without a GPU the kernels run in triton's interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.lora.slots import expand_reference, shrink_reference
from tests.gpu.triton_interpreter import DEVICE, import_kernels, interpreting

(lora_k,) = import_kernels("lora")


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    with interpreting():
        yield


SLOTS, K, R, N = 3, 40, 24, 72  # none a power of two: every tile is masked somewhere


def _meta(groups: dict[int, list[int]], slots: int = SLOTS) -> torch.Tensor:
    """[start by slot, count by slot, rows grouped by slot]."""
    starts, counts, rows = [0] * slots, [0] * slots, []
    for slot, members in groups.items():
        starts[slot], counts[slot] = len(rows), len(members)
        rows += members
    return torch.tensor(starts + counts + rows, dtype=torch.int64)


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(37, K, generator=g)
    a = torch.randn(SLOTS, R, K, generator=g)
    b = torch.randn(SLOTS, N, R, generator=g)
    out = torch.randn(37, N, generator=g)
    # slot 1 unused; slot 2's rows more than one tile and out of order; rows 0, 5, 9... are base rows
    groups = {0: [3, 1, 30], 2: [int(r) for r in np.random.default_rng(seed).permutation(range(10, 30))]}
    return x, a, b, out, groups


def test_references_equal_per_row_lora():
    x, a, b, out, groups = _case()
    meta = _meta(groups)
    want = out.clone()
    for slot, rows in groups.items():
        for r in rows:
            want[r] += b[slot] @ (a[slot] @ x[r])
    got = out.clone()
    y = shrink_reference(x, a, meta, 40)
    expand_reference(y, b, got, meta, 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    base = [r for r in range(37) if all(r not in rows for rows in groups.values())]
    assert torch.equal(got[base], out[base])  # a base row is never touched


@pytest.mark.parametrize("max_rows", [23, 40])  # the grid's rows: exactly the step's, or a graph's bucket
def test_kernels_match_references(max_rows):
    x, a, b, out, groups = _case(1)
    meta = _meta(groups)
    want = out.clone()
    expand_reference(shrink_reference(x, a, meta, max_rows), b, want, meta, max_rows)
    y = lora_k.lora_shrink(x.to(DEVICE), a.to(DEVICE), meta.to(DEVICE), max_rows)
    torch.testing.assert_close(
        y[:23].cpu(), shrink_reference(x, a, meta, max_rows)[:23], rtol=1e-5, atol=1e-4
    )
    got = out.to(DEVICE)
    lora_k.lora_expand(y, b.to(DEVICE), got, meta.to(DEVICE), max_rows)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-4)


def test_no_rows_touch_nothing():
    x, a, b, out, _ = _case(2)
    meta = _meta({})
    got = out.to(DEVICE)
    y = lora_k.lora_shrink(x.to(DEVICE), a.to(DEVICE), meta.to(DEVICE), 16)
    lora_k.lora_expand(y, b.to(DEVICE), got, meta.to(DEVICE), 16)
    assert torch.equal(got.cpu(), out)


def test_half_precision_within_rounding():
    x, a, b, out, groups = _case(3)
    meta = _meta(groups)
    h = {n: t.half() for n, t in dict(x=x, a=a / 4, b=b / 4, out=out).items()}
    want = h["out"].float()
    expand_reference(shrink_reference(h["x"], h["a"], meta, 23), h["b"], want, meta, 23)
    got = h["out"].to(DEVICE)
    y = lora_k.lora_shrink(h["x"].to(DEVICE), h["a"].to(DEVICE), meta.to(DEVICE), 23)
    lora_k.lora_expand(y, h["b"].to(DEVICE), got, meta.to(DEVICE), 23)
    torch.testing.assert_close(got.cpu().float(), want, rtol=3e-3, atol=3e-2)
