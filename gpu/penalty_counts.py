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

from gpu.sampling_table import SamplingTable
from gpu.transfer import tensors_to

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
    """The count rows of the penalised sequences, and which sequence holds which (sequences are known by
    their row in the engine's sampling table, gpu/sampling_table.py, where their settings are)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.counts: torch.Tensor | None = None  # [capacity, V] int32, on the logits' device once used
        self.seen: torch.Tensor | None = None  # [capacity, V] bool
        self._slot_at = np.full(_FIRST_CAPACITY, -1, dtype=np.int64)  # table row -> its slot (-1: none yet)
        self._free: list[int] = []
        self._used = 0  # slots handed out at least once
        self.version = 0  # counts changes of which sequence holds which slot (a step's rows may be reused)
        # table row -> (its prompt's ids, the tokens it started with), until it first runs
        self._start: dict[int, tuple[Sequence[int], Sequence[int]]] = {}

    @property
    def held(self) -> int:
        """Slots held by live sequences."""
        return self._used - len(self._free)

    def add(self, row: int, prompt: Sequence[int], generated: Sequence[int] = ()) -> None:
        self.version += 1
        if row >= len(self._slot_at):
            self._slot_at = np.concatenate([self._slot_at, np.full(row + 1, -1, dtype=np.int64)])
        self._slot_at[row] = -1
        self._start[row] = (prompt, generated)

    def drop(self, row: int) -> None:
        self.version += 1
        self._start.pop(row, None)
        slot = int(self._slot_at[row])
        if slot >= 0:
            self._free.append(slot)
            self._slot_at[row] = -1

    def rows(self, rows: np.ndarray, table_rows: np.ndarray, table: SamplingTable) -> CountedRows:
        """The step's penalised rows (logits rows, and their sequences' table rows), slots given to those
        in a step for the first time."""
        slots = self._slot_at[table_rows]
        fresh, prompts, generated = [], [], []
        for j in np.flatnonzero(slots < 0).tolist():  # newcomers: built from their prompt and first tokens
            self.version += 1
            row = int(table_rows[j])
            slot = self._free.pop() if self._free else self._take()
            slots[j] = self._slot_at[row] = slot
            prompt, before = self._start.pop(row, ((), ()))
            fresh.append(slot)
            prompts.append(np.unique(np.asarray(prompt, dtype=np.int64)))
            generated.append(np.asarray(before, dtype=np.int64))
        repetition = table.repetition[table_rows]
        return CountedRows(
            rows=torch.from_numpy(rows),
            slots=torch.from_numpy(slots),
            presence=torch.from_numpy(table.presence[table_rows]),
            frequency=torch.from_numpy(table.frequency[table_rows]),
            repetition=torch.from_numpy(repetition),
            any_repetition=bool((repetition != 1.0).any()),
            capacity=self._used,
            fresh=torch.tensor(fresh, dtype=torch.int64) if fresh else _NONE,
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


_NONE = torch.zeros(0, dtype=torch.int64)


def _slots_of(slots: list[int], arrays: list[np.ndarray]) -> torch.Tensor:
    if not slots:
        return _NONE
    return torch.from_numpy(np.repeat(np.array(slots, dtype=np.int64), [len(a) for a in arrays]))


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else _NONE.numpy()
