"""One consumer for every job a client follows: the tokens and results topics are read once, by one
thread, and each record goes to the followers of its key.

A follower asks for its job's records from a time on (when it was submitted). The hub reads only the
partitions its followers' keys live on; a follower that needs older records than a partition's position
moves that partition back, and the others on it see records again, which they drop (token events by
(attempt, seq); a result is taken once). Once a partition has been read up to where it ended when the
follower joined, the follower is told (`CaughtUp`): what it wants was not there, so far. A follower that
finds a hole in what it got asks for its records again (`rewind`): it is placed as if it had just joined,
and told when that read has caught up.

Built for many followers at once (the HTTP API follows every job it waits for here): the follows that
arrive together are placed together, with one time look-up and one end look-up for all their partitions,
and a record goes to the followers of its key through an index, never past every follower of its partition.
A follower's items reach it through a queue it reads (`get`), or through a `sink` it was given (called on
the hub's thread: an event loop's thread-safe hand-off).
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
    # partition -> the offset past the last record delivered: a partition read again for a follower placed
    # later (or rewound) must not hand this one the records it already has
    delivered: dict[Partition, int] = field(default_factory=dict)
    hub: StreamHub | None = field(default=None, repr=False)
    sink: Callable[[Record | CaughtUp | Failed], None] | None = field(default=None, repr=False)

    def deliver(self, item: Record | CaughtUp | Failed) -> None:
        """Hand an item to the follower (on the hub's thread)."""
        if self.sink is not None:
            self.sink(item)
        else:
            self.queue.put(item)

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
        # the hub thread's own: (partition, key) -> its followers, and the followers not caught up yet
        self._routes: dict[tuple[Partition, bytes], list[Follower]] = {}
        self._waiting: set[Follower] = set()
        self._thread = threading.Thread(target=self._run, name="inferq-stream-hub", daemon=True)
        self._thread.start()

    def knows(self, topic: str) -> bool:
        return topic in self._counts

    def learn(self, topic: str, partitions: int) -> None:
        """A topic followers may read from now on (e.g. another tenant's, with per-tenant topics)."""
        self._counts[topic] = partitions

    def follow(
        self,
        job_id: str,
        topics: tuple[str, ...],
        since_ms: int,
        sink: Callable[[Record | CaughtUp | Failed], None] | None = None,
    ) -> Follower:
        """`sink`: called with each item instead of queueing it (on the hub's thread: it must not block)."""
        parts = tuple((t, partition_for_key(job_id, self._counts[t])) for t in topics)
        follower = Follower(job_id.encode(), since_ms, parts, hub=self, sink=sink)
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
                routes = self._routes
                for record in self._poll(reader):
                    for f in routes.get((record.source, record.key), ()):
                        if record.timestamp_ms >= f.since_ms and record.offset >= f.delivered.get(
                            record.source, 0
                        ):
                            f.delivered[record.source] = record.offset + 1
                            f.deliver(record)
                self._report_caught_up(reader)
        except Exception as exc:  # noqa: BLE001 - whatever stops the thread is every follower's error
            log.warning("stream hub stopped: %s", exc)
            for f in {f for fs in followers.values() for f in fs}:
                f.deliver(Failed(exc))
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
                    f.deliver(Failed(exc))
            self._wake.wait(_RETRY_WAIT_S)
            return None

    def _apply_commands(self, reader: PartitionReader, followers: dict[Partition, list[Follower]]) -> None:
        changed = False
        placements: list[tuple[Follower, int]] = []
        while not self._commands.empty():
            kind, f, placement = self._commands.get()
            changed = True
            if kind == "unfollow":
                placements = [(g, n) for g, n in placements if g is not f]
                self._drop(followers, f)
                continue
            if kind == "rewind" and f not in followers.get(f.partitions[0], ()):
                continue  # unfollowed (or failed) meanwhile
            placements.append((f, placement))
        if placements:
            try:
                self._place(reader, followers, placements)
            except Exception as exc:  # noqa: BLE001 - e.g. a look-up timed out: these followers fail
                log.warning("stream hub: %d followers could not be placed: %r", len(placements), exc)
                for f, _ in placements:
                    self._drop(followers, f)
                    f.deliver(Failed(exc))
        if changed:
            reader.assign(set(followers))

    def _drop(self, followers: dict[Partition, list[Follower]], f: Follower) -> None:
        self._waiting.discard(f)
        for p in f.partitions:
            if f in followers.get(p, []):
                followers[p].remove(f)
                if not followers[p]:
                    del followers[p]
            route = self._routes.get((p, f.key))
            if route is not None and f in route:
                route.remove(f)
                if not route:
                    del self._routes[(p, f.key)]

    def _place(
        self,
        reader: PartitionReader,
        followers: dict[Partition, list[Follower]],
        placements: list[tuple[Follower, int]],
    ) -> None:
        """Position the followers' partitions so that each one's records since its `since_ms` are read
        (again): one look-up of the earliest time asked of each partition, one of their ends."""
        since: dict[Partition, int] = {}
        for f, _ in placements:
            for p in f.partitions:
                since[p] = min(since.get(p, f.since_ms), f.since_ms)
        targets = reader.offsets_at(since)
        ends = reader.end_offsets(list(since))
        new = {p for p in since if p not in followers}
        reader.assign(set(followers) | set(since))
        for p, target in targets.items():
            if p in new or target < reader.position(p):
                reader.seek(p, target)
        for f, placement in placements:
            f.delivered.clear()  # placed (or rewound): its records since `since_ms` are read for it again
            for p in f.partitions:
                f.pending[p] = ends[p]
                if f not in followers.setdefault(p, []):
                    followers[p].append(f)
                    self._routes.setdefault((p, f.key), []).append(f)
            f.placed = placement
            self._waiting.add(f)

    def _report_caught_up(self, reader: PartitionReader) -> None:
        if not self._waiting:
            return
        positions: dict[Partition, int] = {}
        for f in list(self._waiting):
            for p in list(f.pending):
                if p not in positions:
                    positions[p] = reader.position(p)
                if positions[p] >= f.pending[p]:
                    del f.pending[p]
            if not f.pending:
                self._waiting.discard(f)
                f.deliver(CaughtUp(f.placed))
