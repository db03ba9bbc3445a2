"""Penalty counts kept on the device (the CUDA path's; gpu/logits_processors.py keeps the CPU path's).

On the CPU each penalised sequence's distinct tokens and their counts live on the host, and only those
logits are touched: O(distinct tokens) a row, the cheapest there is for the CPU's compute. On a device that
is host work for every row of every step (gather the pairs, copy them, count each sampled token in Python),
growing with the context, while the device waits. Here every penalised sequence that has run holds a row of
the vocabulary: how often it generated each token (`counts`, int32) and whether its prompt holds it (`seen`),
so a step's host work is its rows' slots and settings, the penalties are a few dense row operations, and the
sampled tokens are counted by the device itself (`count`), read by nobody. The formulas are the CPU path's,
operation for operation, so both give the same logits.

A sequence gets its slot the first time it is in a step, its row built then from its prompt and the tokens it
started with (a resumed sample's), and keeps it until it ends (preemption keeps the counts: they belong to
the request). Memory: 5 bytes a vocabulary entry per running penalised sequence, grown by doubling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu.transfer import tensors_to
from scheduler.types import SamplingParams

_FIRST_CAPACITY = 8


@dataclass(frozen=True)
class CountedRows:
    """A step's penalised rows on the device path: where their counts are, their settings, and the rows to
    build first (sequences in a step for the first time)."""

    rows: torch.Tensor  # [P] int64 the logits rows
    slots: torch.Tensor  # [P] int64 their count rows
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32 (1: off)
    any_repetition: bool
    capacity: int  # count rows the step needs
    fresh: torch.Tensor  # [Z] int64 slots to build: zeroed, then
    seen_slots: torch.Tensor  # [N] int64 prompt tokens seen: seen[slot, id] = True
    seen_ids: torch.Tensor  # [N] int64
    counted_slots: torch.Tensor  # [M] int64 tokens generated before: counts[slot, id] += 1
    counted_ids: torch.Tensor  # [M] int64

    def to(self, device: torch.device) -> CountedRows:
        return tensors_to(self, device)


class DeviceCounts:
    """The count rows of the penalised sequences, and which sequence holds which."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.counts: torch.Tensor | None = None  # [capacity, V] int32, on the logits' device once used
        self.seen: torch.Tensor | None = None  # [capacity, V] bool
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._used = 0  # slots handed out at least once
        # sequence id -> (its prompt's ids, the tokens it started with), until it first runs
        self._start: dict[str, tuple[Sequence[int], Sequence[int]]] = {}

    def add(self, seq_id: str, prompt: Sequence[int], generated: Sequence[int] = ()) -> None:
        self._start[seq_id] = (prompt, generated)

    def drop(self, seq_id: str) -> None:
        self._start.pop(seq_id, None)
        slot = self._slot.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def rows(
        self, rows: Sequence[int], seq_ids: Sequence[str], params: Sequence[SamplingParams]
    ) -> CountedRows:
        """The step's penalised rows (logits row, sequence, settings), slots given to newcomers."""
        slots, fresh, prompts, generated = [], [], [], []
        for seq_id in seq_ids:
            slot = self._slot.get(seq_id)
            if slot is None:
                slot = self._slot[seq_id] = self._free.pop() if self._free else self._take()
                prompt, before = self._start.pop(seq_id, ((), ()))
                fresh.append(slot)
                prompts.append(np.unique(np.asarray(prompt, dtype=np.int64)))
                generated.append(np.asarray(before, dtype=np.int64))
            slots.append(slot)
        return CountedRows(
            rows=torch.tensor(rows, dtype=torch.int64),
            slots=torch.tensor(slots, dtype=torch.int64),
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
            any_repetition=any(p.repetition_penalty != 1.0 for p in params),
            capacity=self._used,
            fresh=torch.tensor(fresh, dtype=torch.int64),
            seen_slots=_slots_of(fresh, prompts),
            seen_ids=torch.from_numpy(_concat(prompts)),
            counted_slots=_slots_of(fresh, generated),
            counted_ids=torch.from_numpy(_concat(generated)),
        )

    def _take(self) -> int:
        self._used += 1
        return self._used - 1

    def apply(self, logits: torch.Tensor, rows: CountedRows) -> None:
        """Repetition, presence and frequency penalties on the counted rows of logits [S, V], in place (after
        the bias), as the CPU path computes them; `rows` on the logits' device."""
        self._hold(logits.device, rows.capacity)
        counts, seen = self.counts, self.seen
        assert counts is not None and seen is not None
        if len(rows.fresh):
            counts.index_fill_(0, rows.fresh, 0)
            seen.index_fill_(0, rows.fresh, False)
            present = torch.ones_like(rows.seen_ids, dtype=torch.bool)
            seen.index_put_((rows.seen_slots, rows.seen_ids), present)
            ones = torch.ones_like(rows.counted_ids, dtype=torch.int32)
            counts.index_put_((rows.counted_slots, rows.counted_ids), ones, accumulate=True)
        generated = counts.index_select(0, rows.slots).float()
        values = logits.index_select(0, rows.rows).float()
        if rows.any_repetition:
            penalty = rows.repetition[:, None]
            repeated = seen.index_select(0, rows.slots) | (generated > 0)
            penalised = torch.where(values > 0, values / penalty, values * penalty)
            values = torch.where(repeated, penalised, values)
        values -= rows.frequency[:, None] * generated + rows.presence[:, None] * (generated > 0)
        logits.index_copy_(0, rows.rows, values.to(logits.dtype))

    def count(self, tokens: torch.Tensor, rows: CountedRows) -> None:
        """The step's sampled tokens [S] (on the device) counted in their rows' counts."""
        assert self.counts is not None
        picked = tokens.index_select(0, rows.rows)
        ones = torch.ones_like(picked, dtype=torch.int32)
        self.counts.index_put_((rows.slots, picked), ones, accumulate=True)

    def _hold(self, device: torch.device, capacity: int) -> None:
        """Count rows for `capacity` slots on `device` (allocated on first use, doubled as needed)."""
        have = 0 if self.counts is None else self.counts.shape[0]
        if have >= capacity and self.counts is not None:
            return
        size = max(_FIRST_CAPACITY, 2 * have, capacity)
        counts = torch.zeros(size, self.vocab_size, dtype=torch.int32, device=device)
        seen = torch.zeros(size, self.vocab_size, dtype=torch.bool, device=device)
        if self.counts is not None and self.seen is not None:
            counts[:have] = self.counts
            seen[:have] = self.seen
        self.counts, self.seen = counts, seen


def _slots_of(slots: list[int], arrays: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.repeat(np.array(slots, dtype=np.int64), [len(a) for a in arrays]))


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
