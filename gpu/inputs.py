"""Flatten one SchedulerOutput into the tensors a batched forward needs, keeping block tables between steps.

Each live sequence holds a seat: a row of one persistent block-table array. A step writes only the blocks
a sequence gained since its last step; token positions and KV slots are computed with numpy over the whole
step at once. On the CPU, attention kernels read the persistent table directly (rows by seat), so no
per-step table is built for them; under async scheduling on the CPU, whose step runs while the next is
built, a step's table is its own chunks' rows up to its widest context, seat i being chunk i.
On CUDA the persistent table lives on the device too (`device_tables`): each step carries the entries
written since the step before (`TableUpdates`, a few per step: the blocks its sequences gained), applied
on the device in step order, so no step copies a table (256 seats x 8,192 blocks is 16.8 MB).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu.attention.metadata import AttentionMetadata, PrefillChunk
from scheduler.output import ScheduledChunk, SchedulerOutput

_NO_ROWS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class TableUpdates:
    """The block-table entries written since the last step's, for a copy of the table kept elsewhere (the
    device's): entry `index[i]` (seat * max_blocks + block) is now `values[i]`. Applied in step order, they
    bring a table of `seats` rows up to date with the host's for every seat a step reads."""

    seats: int  # rows of the host table: the copy grows to as many
    width: int  # entries a row (the flat positions' stride)
    index: np.ndarray  # [N] int64 flat positions
    values: np.ndarray  # [N] int64 block ids


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 position of every token in its sequence
    slots: torch.Tensor  # [T] int64 flat KV slot (block * block_size + offset) where each token's K/V goes
    attention: AttentionMetadata
    sample_rows: torch.Tensor  # [S] rows whose hidden state predicts a sampled token
    sample_chunks: tuple[ScheduledChunk, ...]  # the S chunks that sample, in the same order
    # Async scheduling: rows whose token is a PLACEHOLDER (sampled by the step still in flight), and each
    # one's index in that step's sampling order; the runner fills them in once those tokens are known.
    placeholder_rows: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    placeholder_from: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    table_updates: TableUpdates | None = None  # device_tables builders: what changed since the last step


class InputBuilder:
    def __init__(
        self,
        block_size: int,
        max_model_len: int,
        seats: int = 64,
        device_tables: bool = False,
    ) -> None:
        """device_tables: every step carries its TableUpdates for the device's copy of the table (and
        async scheduling's steps need no rows of their own: the device applies a step's updates only after
        the step before has read the table)."""
        self.block_size = block_size
        self.device_tables = device_tables
        self._log: list[tuple[int, int, int]] = []  # (seat, first, end) written since the last build
        self.max_blocks = -(-max_model_len // block_size)
        self._tables = np.zeros((seats, self.max_blocks), dtype=np.int64)
        self._known = np.zeros(seats, dtype=np.int64)  # blocks written per seat
        # The block-table tuple each seat's row was last brought up to date with: a chunk carrying that
        # very object (a sequence keeps its tuple until its blocks change) needs nothing written.
        self._written: list[tuple[int, ...] | None] = [None] * seats
        self._seat: dict[str, int] = {}
        self._free = list(range(seats - 1, -1, -1))  # pop() hands out low seats first

    @property
    def block_tables(self) -> np.ndarray:
        return self._tables

    def release(self, seq_id: str) -> None:
        """The sequence ended or was preempted: its seat (and blocks) are no longer its own."""
        seat = self._seat.pop(seq_id, None)
        if seat is not None:
            self._known[seat] = 0
            self._written[seat] = None
            self._free.append(seat)

    def forget(self) -> None:
        """The device's copy may have missed updates (a step failed between its build and its launch):
        every seat's next step writes its whole row again."""
        self._known[:] = 0
        self._written = [None] * len(self._written)

    def seat_of(self, chunk: ScheduledChunk) -> int:
        """The chunk's seat, its table brought up to date with the blocks it gained."""
        seat = self._seat.get(chunk.seq_id)
        if seat is None:
            seat = self._seat[chunk.seq_id] = self._take_seat()
        table = chunk.block_table
        if table is self._written[seat]:
            return seat
        known = int(self._known[seat])
        if known and (len(table) < known or table[known - 1] != self._tables[seat, known - 1]):
            known = 0  # a new table for this sequence (preempted and readmitted without a release)
        if len(table) > known:
            row = self._tables[seat, known : len(table)]
            row[:] = table[known:]
            if not known:  # a whole table may start with places given back (NO_BLOCK, behind the window):
                np.maximum(row, 0, out=row)  # any block reads there; every query masks those keys out
            if self.device_tables:
                self._log.append((seat, known, len(table)))
            self._known[seat] = len(table)
        self._written[seat] = table if isinstance(table, tuple) else None  # a list could change later
        return seat

    def _take_seat(self) -> int:
        if not self._free:  # more live sequences than expected: grow rather than fail
            old = len(self._tables)
            self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)])
            self._known = np.concatenate([self._known, np.zeros_like(self._known)])
            self._written += [None] * old
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def _updates(self) -> TableUpdates:
        """The entries written since the last call, their values as they are now."""
        log, self._log = self._log, []
        if not log:
            return TableUpdates(len(self._tables), self.max_blocks, _NO_ROWS, _NO_ROWS)
        seats, firsts, ends = np.array(log, dtype=np.int64).T
        lengths = ends - firsts
        total = int(lengths.sum())
        # each entry's block: its range's first plus its offset inside the range
        offsets = np.arange(total, dtype=np.int64)
        blocks = np.repeat(firsts - (np.cumsum(lengths) - lengths), lengths) + offsets
        rows = np.repeat(seats, lengths)
        index = rows * self.max_blocks + blocks
        return TableUpdates(len(self._tables), self.max_blocks, index, self._tables[rows, blocks])

    def build(self, output: SchedulerOutput, previous: list[str] | None = None) -> StepInputs:
        """The step's inputs. `previous` (async scheduling): the sequences of the in-flight step that
        sample, in order, for the placeholder tokens; the step then gets its own rows of the block table
        (unless device_tables), since the next build changes the persistent one (and may give a seat to
        another sequence) while this step runs."""
        chunks = output.chunks
        count = len(chunks)
        seat_of, written, seat = self.seat_of, self._written, self._seat
        seats = np.array(
            [
                s if (s := seat.get(c.seq_id)) is not None and c.block_table is written[s] else seat_of(c)
                for c in chunks
            ],
            dtype=np.int64,
        )
        starts = np.array([c.start_position for c in chunks], dtype=np.int64)
        all_decode = output.num_decodes == count  # one token a chunk, each sampling: the common step
        if all_decode:
            lengths = np.ones(count, dtype=np.int64)
        else:
            lengths = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
        total = int(lengths.sum())
        if total == count:  # one token a chunk (an all-decode step): rows are chunks
            ends = np.arange(1, count + 1, dtype=np.int64)
            positions = starts
            token_seats = seats
            ids = np.array([c.token_ids[0] for c in chunks], dtype=np.int64)
        else:
            ends = np.cumsum(lengths)
            # Every token's position: its chunk's start plus its offset inside the chunk.
            positions = np.repeat(starts - (ends - lengths), lengths) + np.arange(total, dtype=np.int64)
            token_seats = np.repeat(seats, lengths)
            ids = np.fromiter(
                itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64, count=total
            )
        row_starts = ends - lengths
        bs = self.block_size
        slots = self._tables[token_seats, positions // bs] * bs + positions % bs
        single = lengths == 1
        decode_rows = row_starts[single]
        first = int(decode_rows[0]) if len(decode_rows) else None
        contiguous = first is not None and int(decode_rows[-1]) - first == len(decode_rows) - 1
        decode_lens = starts[single] + 1
        prefills = tuple(
            PrefillChunk(int(row_starts[i]), int(lengths[i]), int(starts[i]), int(seats[i]))
            for i in np.flatnonzero(~single)
        )
        sample = [True] if all_decode else [c.sample for c in chunks]
        if all(sample):  # the common case: every chunk samples
            sample_rows, sample_chunks = ends - 1, tuple(chunks)
        else:
            picked = np.flatnonzero(np.array(sample, dtype=bool))
            sample_rows, sample_chunks = ends[picked] - 1, tuple(chunks[i] for i in picked)
        placeholder_rows = placeholder_from = _NO_ROWS
        if previous is not None:
            placeholder_rows = np.flatnonzero(ids < 0)
            if len(placeholder_rows):  # only ever a chunk's last token: the one its sequence sampled last
                owners = (
                    placeholder_rows if total == count else np.searchsorted(ends, placeholder_rows, "right")
                )
                names = [chunks[i].seq_id for i in owners.tolist()]
                if names == previous:  # the same sequences in the same order: the common decode step
                    placeholder_from = np.arange(len(names), dtype=np.int64)
                else:
                    index = {seq_id: i for i, seq_id in enumerate(previous)}
                    placeholder_from = np.array([index[n] for n in names], dtype=np.int64)
        tables, table_seats = self._tables, seats
        updates = self._updates() if self.device_tables else None
        if previous is not None and not self.device_tables:  # the step's own rows: chunk i's in row i
            width = -(-int((starts + lengths).max()) // bs) if count else 0
            tables, table_seats = self._tables[seats, :width], np.arange(count, dtype=np.int64)
            chunk_of = np.flatnonzero(~single).tolist()
            prefills = tuple(dataclasses.replace(c, seat=i) for c, i in zip(prefills, chunk_of, strict=True))
        attention = AttentionMetadata(
            block_tables=torch.from_numpy(tables),
            decode_rows=torch.from_numpy(decode_rows),
            decode_seats=torch.from_numpy(table_seats[single]),
            decode_lens=torch.from_numpy(decode_lens),
            decode_first=first if contiguous else None,
            max_decode_len=int(decode_lens.max()) if len(decode_lens) else 0,
            prefills=prefills,
        )
        return StepInputs(
            input_ids=torch.from_numpy(ids),
            positions=torch.from_numpy(positions),
            slots=torch.from_numpy(slots),
            attention=attention,
            sample_rows=torch.from_numpy(sample_rows),
            sample_chunks=sample_chunks,
            placeholder_rows=placeholder_rows,
            placeholder_from=placeholder_from,
            table_updates=updates,
        )
