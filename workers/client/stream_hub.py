"""One consumer for every job a client follows: the tokens and results topics are read once, by one
thread, and each record goes to the followers of its key.

A follower asks for its job's records from a time on (when it was submitted). The hub reads only the
partitions its followers' keys live on; a follower that needs older records than a partition's position
moves that partition back, and the others on it see records again, which they drop (token events by
(attempt, seq); a result is taken once). Once a partition has been read up to where it ended when the
follower joined, the follower is told (`CaughtUp`): what it wants was not there, so far. A follower that
finds a hole in what it got asks for its records again (`rewind`): it is placed as if it had just joined,
and told when that read has caught up.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.kafka_io import Partition, PartitionReader, Record, partition_for_key

log = logging.getLogger(__name__)

_RETRY_WAIT_S = 0.2  # after the broker could not be reached, before the next try (a new follower wakes it)
# While it reads, the thread looks at its commands this often: a follower waits at most this long (plus its
# partitions' look-ups) to be placed. kafka-python's poll cannot be woken from another thread, so it polls in
# slices; the fetch request stays in flight at the broker across them (each slice: a select, ~0.1 ms CPU).
_COMMAND_SLICE_S = 0.01


@dataclass(frozen=True)
class CaughtUp:
    """The follower's partitions have been read to where they ended when it was placed (joined, or the
    `placement`-th rewind)."""

    placement: int = 0


@dataclass(frozen=True)
class Failed:
    """The hub could not serve the follower (e.g. the broker did not answer a look-up in time)."""

    error: BaseException


@dataclass(eq=False)
class Follower:
    """One job's records (`Record`, then `CaughtUp` once, or `Failed`), from `since_ms` on."""

    key: bytes
    since_ms: int
    partitions: tuple[Partition, ...]
    queue: queue.Queue = field(default_factory=queue.Queue)
    pending: dict[Partition, int] = field(default_factory=dict)  # partition -> end offset still to reach
    placement: int = 0  # rewinds asked for (by the follower's own thread)
    placed: int = 0  # the placement the hub made last (its CaughtUp tells this number)
    hub: StreamHub | None = field(default=None, repr=False)

    def rewind(self) -> int:
        """See `StreamHub.rewind`."""
        assert self.hub is not None
        return self.hub.rewind(self)

    def get(self, timeout_s: float) -> Record | CaughtUp | Failed | None:
        try:
            return self.queue.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return None


class StreamHub:
    def __init__(
        self,
        reader_factory: Callable[[], PartitionReader],
        partition_counts: dict[str, int],
        poll_s: float = 0.2,
    ) -> None:
        """`partition_counts`: topic -> partitions, for the topics followers read (keys are placed as the
        producer places them)."""
        self._reader_factory = reader_factory
        self._counts = dict(partition_counts)
        self._poll_s = poll_s
        self._commands: queue.Queue[tuple[str, Follower, int]] = queue.Queue()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by follow and close: the thread looks at its commands now
        self._thread = threading.Thread(target=self._run, name="inferq-stream-hub", daemon=True)
        self._thread.start()

    def knows(self, topic: str) -> bool:
        return topic in self._counts

    def learn(self, topic: str, partitions: int) -> None:
        """A topic followers may read from now on (e.g. another tenant's, with per-tenant topics)."""
        self._counts[topic] = partitions

    def follow(self, job_id: str, topics: tuple[str, ...], since_ms: int) -> Follower:
        parts = tuple((t, partition_for_key(job_id, self._counts[t])) for t in topics)
        follower = Follower(job_id.encode(), since_ms, parts, hub=self)
        self._commands.put(("follow", follower, 0))
        self._wake.set()
        return follower

    def rewind(self, follower: Follower) -> int:
        """Read the follower's records since its `since_ms` again (others on its partitions drop copies);
        returns the number its `CaughtUp` will carry once that read has reached the partitions' ends."""
        follower.placement += 1
        self._commands.put(("rewind", follower, follower.placement))
        self._wake.set()
        return follower.placement

    def unfollow(self, follower: Follower) -> None:
        self._commands.put(("unfollow", follower, 0))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    # ---- the hub's thread ----------------------------------------------------------------------
    def _run(self) -> None:
        reader: PartitionReader | None = None
        followers: dict[Partition, list[Follower]] = {}
        try:
            while not self._stop.is_set():
                self._wake.clear()  # first: a follow put after this wakes the wait below
                if reader is None and (followers or not self._commands.empty()):
                    reader = self._open(followers)
                if reader is not None:
                    self._apply_commands(reader, followers)
                if not followers or reader is None:
                    self._wake.wait()  # nothing to read: sleep until a follower (or close) comes
                    continue
                for record in self._poll(reader):
                    for f in followers.get(record.source, ()):
                        if record.key == f.key and record.timestamp_ms >= f.since_ms:
                            f.queue.put(record)
                self._report_caught_up(reader, followers)
        except Exception as exc:  # noqa: BLE001 - whatever stops the thread is every follower's error
            log.warning("stream hub stopped: %s", exc)
            for f in {f for fs in followers.values() for f in fs}:
                f.queue.put(Failed(exc))
        finally:
            if reader is not None:
                reader.close()

    def _poll(self, reader: PartitionReader) -> list[Record]:
        """Records within `poll_s`, returned as soon as any come, or earlier (empty) when woken."""
        deadline = time.monotonic() + self._poll_s
        while True:
            records = reader.poll(min(_COMMAND_SLICE_S, max(0.0, deadline - time.monotonic())))
            if records or self._wake.is_set() or time.monotonic() >= deadline:
                return records

    def _open(self, followers: dict[Partition, list[Follower]]) -> PartitionReader | None:
        try:
            return self._reader_factory()
        except Exception as exc:  # noqa: BLE001 - no broker: tell who is waiting, try again for the next
            while not self._commands.empty():
                kind, f, _ = self._commands.get()
                if kind != "unfollow":
                    f.queue.put(Failed(exc))
            self._wake.wait(_RETRY_WAIT_S)
            return None

    def _apply_commands(self, reader: PartitionReader, followers: dict[Partition, list[Follower]]) -> None:
        changed = False
        while not self._commands.empty():
            kind, f, placement = self._commands.get()
            changed = True
            if kind == "unfollow":
                for p in f.partitions:
                    if f in followers.get(p, []):
                        followers[p].remove(f)
                        if not followers[p]:
                            del followers[p]
                continue
            if kind == "rewind" and f not in followers.get(f.partitions[0], ()):
                continue  # unfollowed (or failed) meanwhile
            try:
                self._place(reader, followers, f, placement)
            except Exception as exc:  # noqa: BLE001 - e.g. a look-up timed out: this follower fails
                f.queue.put(Failed(exc))
        if changed:
            reader.assign(set(followers))

    @staticmethod
    def _place(
        reader: PartitionReader, followers: dict[Partition, list[Follower]], f: Follower, placement: int
    ) -> None:
        """Position the follower's partitions so that its records since `since_ms` are read (again)."""
        targets = {p: reader.offset_at(p, f.since_ms) for p in f.partitions}
        ends = {p: reader.end_offset(p) for p in f.partitions}
        new = {p for p in f.partitions if p not in followers}
        reader.assign(set(followers) | set(f.partitions))
        for p, target in targets.items():
            if p in new or target < reader.position(p):
                reader.seek(p, target)
            f.pending[p] = ends[p]
            if f not in followers.setdefault(p, []):
                followers[p].append(f)
        f.placed = placement

    @staticmethod
    def _report_caught_up(reader: PartitionReader, followers: dict[Partition, list[Follower]]) -> None:
        positions: dict[Partition, int] = {}
        for p, fs in followers.items():
            for f in fs:
                if p in f.pending:
                    positions.setdefault(p, reader.position(p))
                    if positions[p] >= f.pending[p]:
                        del f.pending[p]
                        if not f.pending:
                            f.queue.put(CaughtUp(f.placed))
