"""Deadlines of live sequences, soonest first. An ended sequence leaves at once (no lingering entry
keeps it alive until its deadline passes): entries are dropped lazily and the heap is rebuilt whenever
dead entries would outnumber live ones, so its size stays within twice the live count."""

from __future__ import annotations

import heapq

from scheduler.sequence import Sequence


class DeadlineHeap:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Sequence]] = []
        self._live: set[Sequence] = set()

    def __len__(self) -> int:
        """Live sequences with a deadline."""
        return len(self._live)

    @property
    def num_entries(self) -> int:
        """Entries held, dead ones included (at most twice the live count, plus one)."""
        return len(self._heap)

    def add(self, seq: Sequence, deadline: float) -> None:
        self._live.add(seq)
        heapq.heappush(self._heap, (deadline, seq.order, seq))

    def discard(self, seq: Sequence) -> None:
        """The sequence ended; forget its deadline."""
        if seq not in self._live:
            return
        self._live.remove(seq)
        self._compact()

    def pop_expired(self, now: float) -> list[Sequence]:
        """Live sequences whose deadline is before now (they are removed)."""
        expired = []
        while self._heap and self._heap[0][0] < now:
            _, _, seq = heapq.heappop(self._heap)
            if seq in self._live:
                self._live.remove(seq)
                expired.append(seq)
        self._compact()
        return expired

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._live) + 1:
            self._heap = [entry for entry in self._heap if entry[2] in self._live]
            heapq.heapify(self._heap)
