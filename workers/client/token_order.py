"""A job's token events handed on in order: each attempt's seqs 0, 1, 2… once each, with no hole.

What comes off the topic may not be that: a producer retry writes an event twice, a redone job starts a
new attempt while the old worker's last events still arrive, and a record can be missed by the reader
(or written after a later one, when a send was retried). `TokenOrder` keeps what is early until the events
before it come; the caller then reads the job's partition again (`StreamHub.rewind`), and only once that
read has caught up with the partition is a hole taken to be final (`skip_gap`).
"""

from __future__ import annotations

from schemas.jobs import TokenEvent


class TokenOrder:
    def __init__(self) -> None:
        self.attempt: int | None = None  # the latest attempt seen: its events are the job's text
        self.next_seq = 0  # the seq of that attempt to hand on next
        self._early: dict[int, TokenEvent] = {}  # seq -> event that came before the ones ahead of it

    @property
    def gap(self) -> bool:
        """Events wait for an earlier one that has not come."""
        return bool(self._early)

    def add(self, event: TokenEvent) -> list[TokenEvent]:
        """The events that are next in line now (none, this one, or this one and those it was holding up)."""
        if self.attempt is not None and event.attempt < self.attempt:
            return []  # an attempt a later one replaced: its text is not the job's
        if event.attempt != self.attempt:  # a new attempt restarts the text at seq 0
            self.attempt, self.next_seq, self._early = event.attempt, 0, {}
        if event.seq < self.next_seq or event.seq in self._early:
            return []  # a copy: a producer retry, or the partition read again
        self._early[event.seq] = event
        return self._take_ready()

    def skip_gap(self) -> list[TokenEvent]:
        """The missing events will not come (the partition was read again to its end): hand on the rest."""
        ready = []
        while self._early:
            self.next_seq = min(self._early)
            ready += self._take_ready()
        return ready

    def _take_ready(self) -> list[TokenEvent]:
        ready = []
        while self.next_seq in self._early:
            ready.append(self._early.pop(self.next_seq))
            self.next_seq += 1
        return ready
