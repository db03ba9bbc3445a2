"""One step's token mask: what each constrained sequence may sample next, applied to its logits row."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from gpu.grammar.native_mask import NativeMask


class TokenMask:
    """A bitmask of a step's sampling rows (one bit per vocabulary entry), reused from step to step.

    Filling depends only on tokens already accepted, so it may run before or during the forward; applying
    it sets every disallowed logit to -inf in place, before any sampling setting is read.
    """

    def __init__(self, vocab_size: int, rows: int) -> None:
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(rows, vocab_size)  # int32 [rows, ceil(V/32)], CPU
        self.native = NativeMask.load()  # None: xgrammar's kernel everywhere

    def fill(self, matchers: Sequence[tuple[int, xgr.GrammarMatcher]]) -> list[int]:
        """Fill the rows of the given (row, matcher) pairs; the rows whose mask forbids anything."""
        if matchers and max(row for row, _ in matchers) >= len(self.bitmask):
            self.bitmask = xgr.allocate_token_bitmask(2 * max(r for r, _ in matchers) + 2, self.vocab_size)
        bitmask = self.bitmask
        return [row for row, matcher in matchers if matcher.fill_next_token_bitmask(bitmask, row)]

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Mask rows of logits [S, V] (CPU or CUDA) in place: float32 on the CPU with the word-at-a-time
        kernel where it built, otherwise with xgrammar's kernel for the device."""
        if not rows:
            return
        if self.native is not None and NativeMask.supports(logits):
            self.native(logits, self.bitmask, rows, self.vocab_size)
            return
        bitmask = self.bitmask[: logits.shape[0]]
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device)  # before the buffer is refilled: a plain copy
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)


def position_masks(count: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of `count` rows (int32 CPU [count, words]), to fill row by row with `fill_row`."""
    return xgr.allocate_token_bitmask(max(count, 1), vocab_size)


def fill_row(bitmask: torch.Tensor, row: int, matcher: xgr.GrammarMatcher) -> None:
    """Row `row` of the bitmask: what the matcher allows next, in its present state."""
    matcher.fill_next_token_bitmask(bitmask, row)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """Mask each row of logits [R, V] in place with the bitmask row of the same index ([R, words], CPU)."""
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device)
    xgr.apply_token_bitmask_inplace(logits, bitmask.contiguous(), vocab_size=vocab_size)
