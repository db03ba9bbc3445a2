"""Every live sequence's sampling settings as numpy columns, a row each (the engine adds and drops them with
its sequences), so that a step of hundreds of rows gathers its settings with a few array lookups instead of
a Python pass per setting per row (gpu/sampler.py, gpu/logits_processors.py, gpu/penalty_counts.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any, TypeVar

import numpy as np

from scheduler.types import SamplingParams

T = TypeVar("T")
_SEQ_ID = attrgetter("seq_id")


class SamplingTable:
    """The live sequences' sampling settings, a row each in numpy columns, added and dropped by the engine
    with its sequences: a step gathers its rows' settings with a few array lookups."""

    _COLUMNS = {
        "keys": np.int64,  # gpu.samples.stream_key of the row's sequence
        "temperature": np.float32,
        "top_k": np.int64,
        "top_p": np.float32,
        "presence": np.float32,
        "frequency": np.float32,
        "repetition": np.float32,
        "penalised": np.bool_,  # any of the three penalties
        "host": np.bool_,  # logit_bias or logprobs: work per row on the host (gpu.logits_processors)
    }

    def __init__(self, capacity: int = 64) -> None:
        self._row: dict[str, int] = {}
        self._free: list[int] = []
        # The last step's sequences and rows, and what was derived from them (`derived`); `version` counts
        # changes to any row's settings, which void them.
        self.version = 0
        self._last: tuple[tuple[str, ...], int, np.ndarray] | None = None
        self._derived: dict[str, Any] = {}
        self.drawing = 0  # live rows with temperature > 0 (none: a step's rows need no lookup at all)
        for name, dtype in self._COLUMNS.items():
            setattr(self, name, np.zeros(capacity, dtype=dtype))
        self.keys: np.ndarray
        self.temperature: np.ndarray
        self.top_k: np.ndarray
        self.top_p: np.ndarray
        self.presence: np.ndarray
        self.frequency: np.ndarray
        self.repetition: np.ndarray
        self.penalised: np.ndarray
        self.host: np.ndarray

    def add(self, seq_id: str, key: int, params: SamplingParams) -> int:
        """The sequence's row (a new one, or the one it has), its settings written in."""
        self.version += 1
        row = self._row.get(seq_id)
        if row is None:
            row = self._row[seq_id] = self._free.pop() if self._free else len(self._row)
        else:
            self.drawing -= bool(self.temperature[row] > 0.0)
        if row >= len(self.keys):  # full: double
            for name in self._COLUMNS:
                column = getattr(self, name)
                setattr(self, name, np.concatenate([column, np.zeros_like(column)]))
        self.keys[row], self.temperature[row] = key, params.temperature
        self.top_k[row], self.top_p[row] = params.top_k, params.top_p
        self.presence[row], self.frequency[row] = params.presence_penalty, params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        self.penalised[row] = (
            params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
        )
        self.host[row] = bool(params.logit_bias) or params.logprobs is not None
        self.drawing += params.temperature > 0.0
        return row

    def drop(self, seq_id: str) -> None:
        row = self._row.pop(seq_id, None)
        if row is not None:
            self.version += 1
            self.drawing -= bool(self.temperature[row] > 0.0)
            self.temperature[row] = 0.0
            self._free.append(row)

    def row(self, seq_id: str) -> int:
        return self._row[seq_id]

    def key(self, seq_id: str) -> int:
        return int(self.keys[self._row[seq_id]])

    def rows(self, chunks: Sequence[Any]) -> np.ndarray:
        """The table rows of the chunks' sequences, in order (int64 [S], read-only: the same array while the
        step's sequences and the table stay the same)."""
        ids = tuple(map(_SEQ_ID, chunks))
        last = self._last
        if last is not None and last[1] == self.version and last[0] == ids:
            return last[2]
        rows = np.fromiter(map(self._row.__getitem__, ids), dtype=np.int64, count=len(ids))
        rows.flags.writeable = False
        self._last, self._derived = (ids, self.version, rows), {}
        return rows

    def derived(self, rows: np.ndarray, name: str, build: Callable[[], T]) -> T:
        """What `build` derives from the settings of `rows` alone (and may be shared, read-only, by the steps
        of these rows): built once while these are the last step's rows and the table is unchanged."""
        last = self._last
        if last is None or last[2] is not rows or last[1] != self.version:
            return build()
        if name not in self._derived:
            self._derived[name] = build()
        return self._derived[name]
