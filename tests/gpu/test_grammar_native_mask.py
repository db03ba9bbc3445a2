"""The word-at-a-time grammar mask kernel against xgrammar's own CPU kernel (the reference)."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from gpu.grammar.mask import TokenMask
from gpu.grammar.native_mask import NativeMask

NATIVE = NativeMask.load()
pytestmark = pytest.mark.skipif(NATIVE is None, reason="no C compiler for the kernel")


def grammar_like_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows as grammars make them: mostly zero words (structure), mostly all-ones words (inside a string),
    and random words, with a few odd words in each."""
    g = torch.Generator().manual_seed(seed)
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    words = bitmask.shape[1]
    random = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    bitmask.copy_(random)
    bitmask[0::3] = 0
    bitmask[1::3] = -1
    odd = torch.randint(0, words, (rows, min(4, words)), generator=g)
    bitmask.scatter_(1, odd, random[:, : odd.shape[1]])
    return bitmask


@pytest.mark.parametrize("vocab", [64, 300, 49152, 49157])
@pytest.mark.parametrize("width_over", [0, 7])
def test_native_mask_equals_xgrammar_kernel(vocab, width_over):
    """Every row kind, a vocabulary not a multiple of 32, logits wider than the vocabulary, and a subset of
    rows in any order: the same logits bit for bit, the other rows untouched."""
    bitmask = grammar_like_bitmask(9, vocab, seed=vocab + width_over)
    logits = torch.randn(9, vocab + width_over, generator=torch.Generator().manual_seed(1))
    rows = [7, 0, 2, 4, 5, 1]
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab, indices=rows)
    NATIVE(logits, bitmask, rows, vocab)
    assert torch.equal(logits, expected)
    assert int(torch.isinf(logits[0]).sum()) >= vocab - 4 * 32  # a zero row but for its odd words


def test_token_mask_uses_the_native_kernel_on_cpu_float32_and_xgrammar_elsewhere(monkeypatch):
    vocab = 1000
    mask = TokenMask(vocab, 4)
    assert mask.native is not None
    mask.bitmask.copy_(grammar_like_bitmask(4, vocab, seed=3))
    logits = torch.randn(4, vocab)
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, mask.bitmask, vocab_size=vocab, indices=[1, 3])
    calls = []
    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace", lambda *a, **k: calls.append(a))
    mask.apply(logits, [1, 3])
    assert torch.equal(logits, reference) and not calls  # native
    mask.apply(logits.half(), [1, 3])  # another dtype: xgrammar's kernel
    assert len(calls) == 1
