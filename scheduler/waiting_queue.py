"""Waiting sequences in admission order: priority class, then tenant fairness, then arrival; with aging.

Order of service: the best (lowest) class with anyone waiting. Inside a class, preempted sequences come
back first (front of their class, most recently preempted last-arrived behind earlier ones); then the
tenant with the fewest tokens served, and within a tenant the earliest arrival.

Sequences move (aging, abort) without searching: every queue entry carries the sequence's `queue_token`
at insertion, and an entry whose token is stale is skipped when it reaches the front. The aging heap's
entries reach its front only when due (aging_s after insertion), so it is compacted once stale entries
outnumber live ones: otherwise it would keep every sequence that passed through the queue in the last
aging_s alive (30,000 finished requests at 1,000 a second, and the collector walking them all).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator

from scheduler.fairness import TenantLedger
from scheduler.sequence import Sequence
from scheduler.types import Priority

_Entry = tuple[float, int, int, Sequence]  # (arrival or due time, order, queue token, sequence)
_COMPACT_SLACK = 64  # stale aging entries tolerated beyond the live ones before the heap is compacted


class _ClassQueue:
    def __init__(self) -> None:
        self.resumed: deque[tuple[int, Sequence]] = deque()  # preempted: (queue token, sequence)
        self.tenants: dict[str, list[_Entry]] = {}  # tenant -> heap by arrival


class WaitingQueue:
    def __init__(self, ledger: TenantLedger, aging_s: float) -> None:
        self._ledger = ledger
        self._aging_s = aging_s if aging_s > 0 and math.isfinite(aging_s) else None
        self._classes = {p: _ClassQueue() for p in Priority}
        self._members: dict[Sequence, Priority] = {}  # live entries: sequence -> class it waits in
        self._counts = dict.fromkeys(Priority, 0)
        self._aging: list[_Entry] = []  # heap of (time of next promotion, order, token, sequence)
        self._aside: list[tuple[Sequence, bool]] = []  # set_aside(): (sequence, was it a resumed one)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._members

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._members))

    def counts(self) -> dict[Priority, int]:
        return dict(self._counts)

    def num_better_than(self, cls: Priority) -> int:
        """Waiting sequences in classes strictly better than cls."""
        return sum(n for p, n in self._counts.items() if p < cls)

    def add(self, seq: Sequence) -> None:
        """A new arrival: placed by arrival within its tenant and class."""
        self._insert(seq)
        heapq.heappush(self._classes[seq.queue_class].tenants.setdefault(seq.tenant, []), self._entry(seq))

    def push_front(self, seq: Sequence, now: float) -> None:
        """A preempted sequence: back to the front of its class, so it keeps its place."""
        seq.class_since = now
        self._insert(seq)
        self._classes[seq.queue_class].resumed.appendleft((seq.queue_token, seq))

    def remove(self, seq: Sequence) -> None:
        cls = self._members.pop(seq)
        self._counts[cls] -= 1
        seq.queue_token += 1  # every entry of it in the heaps is stale now
        if len(self._aging) > 2 * len(self._members) + _COMPACT_SLACK:
            self._aging = [e for e in self._aging if self._is_live(e[2], e[3])]
            heapq.heapify(self._aging)  # amortized O(1) a removal: at least half the entries go each time

    def set_aside(self, seq: Sequence) -> None:
        """Take the head out of the queue until `restore()`: an admission pass looks past it (a sequence
        whose LoRA adapter cannot enter yet) without losing its place."""
        queue = self._classes[seq.queue_class]
        resumed = bool(queue.resumed) and queue.resumed[0][1] is seq
        self.remove(seq)
        self._aside.append((seq, resumed))

    def restore(self) -> None:
        """Every sequence set aside back where it was (a resumed one at the front of its class again)."""
        for seq, resumed in reversed(self._aside):
            if resumed:
                self._insert(seq)
                self._classes[seq.queue_class].resumed.appendleft((seq.queue_token, seq))
            else:
                self.add(seq)
        self._aside.clear()

    def peek(self) -> Sequence | None:
        for cls in Priority:
            if self._counts[cls]:
                return self._peek_class(self._classes[cls])
        return None

    def pop(self) -> Sequence | None:
        seq = self.peek()
        if seq is not None:
            self.remove(seq)
        return seq

    def promote_aged(self, now: float) -> list[Sequence]:
        """Move every sequence that has waited aging_s in its class up one class; returns those moved."""
        moved = []
        while self._aging and self._aging[0][0] <= now:
            due, _, token, seq = heapq.heappop(self._aging)
            if not self._is_live(token, seq):
                continue
            self.remove(seq)
            seq.queue_class = Priority(seq.queue_class - 1)
            seq.class_since = due
            self.add(seq)
            moved.append(seq)
        return moved

    def _insert(self, seq: Sequence) -> None:
        seq.queue_token += 1
        self._members[seq] = seq.queue_class
        self._counts[seq.queue_class] += 1
        if self._aging_s is not None and seq.queue_class > Priority.HIGH:
            due = seq.class_since + self._aging_s
            heapq.heappush(self._aging, (due, seq.order, seq.queue_token, seq))

    def _entry(self, seq: Sequence) -> _Entry:
        return (seq.arrival, seq.order, seq.queue_token, seq)

    def _is_live(self, token: int, seq: Sequence) -> bool:
        return token == seq.queue_token and seq in self._members

    def _peek_class(self, queue: _ClassQueue) -> Sequence | None:
        while queue.resumed:
            token, seq = queue.resumed[0]
            if self._is_live(token, seq):
                return seq
            queue.resumed.popleft()
        best: tuple[int, float, int] | None = None
        best_seq = None
        for tenant in list(queue.tenants):
            heap = queue.tenants[tenant]
            while heap and not self._is_live(heap[0][2], heap[0][3]):
                heapq.heappop(heap)
            if not heap:
                del queue.tenants[tenant]
                continue
            arrival, order, _, seq = heap[0]
            key = (self._ledger.served(tenant), arrival, order)
            if best is None or key < best:
                best, best_seq = key, seq
        return best_seq
