"""The worker's consumer-group member over the jobs (and control) topics.

- Cooperative-sticky assignment (KIP-429): a join or leave revokes only the partitions that really move,
  so jobs of the partitions a worker keeps go on running.
- Offsets are committed only through `commit` (asynchronously: a broker outage never blocks the engine).
- A record batch the client cannot decode (CRC, a codec it lacks, corrupt records, over the
  decompressed-size bound) does not stop the worker or its partition: it comes back once, whole, as one
  `Record` with `undecodable` set that spans the batch (`offset` .. `last_offset`), and the position moves
  past all of it (see `batches`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor
from kafka.coordinator.base import MemberState
from kafka.structs import OffsetAndMetadata

from workers.kafka_io.batches import guard, recover
from workers.kafka_io.codec import DEFAULT_MAX_DECOMPRESSED
from workers.kafka_io.records import Partition, Record, to_record
from workers.kafka_io.stalls import StallWatch
from workers.settings import KafkaConnection

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalanceEvent:
    # "revoked": handed over cleanly; "lost": membership lost (another member may own them); "assigned"
    kind: str
    partitions: tuple[Partition, ...]


class _Listener(ConsumerRebalanceListener):
    """Runs on the client's I/O thread: it records events, which the engine loop acts on, and pauses
    newly assigned partitions of held topics before anything is fetched from them."""

    def __init__(self, events: queue.Queue[RebalanceEvent], hold: Callable[[Iterable], None]) -> None:
        self.events = events
        self.hold = hold

    def _push(self, kind: str, tps) -> None:
        self.events.put(RebalanceEvent(kind, tuple(sorted((tp.topic, tp.partition) for tp in tps))))

    def on_partitions_revoked(self, revoked) -> None:
        self._push("revoked", revoked)

    def on_partitions_assigned(self, assigned) -> None:
        try:
            self.hold(assigned)
        except Exception:  # noqa: BLE001 - the next poll applies the holds anyway; the event must go out
            log.exception("pausing newly assigned partitions of held topics failed")
        self._push("assigned", assigned)

    def on_partitions_lost(self, lost) -> None:
        self._push("lost", lost)


PATTERN_REFRESH_MS = 30_000  # how soon a pattern subscription finds a new topic (a new tenant's)
SESSION_TIMEOUT_MS = 10_000
MAX_POLL_RECORDS = 256


@dataclass(frozen=True)
class Membership:
    """Where this member stands in its group, as far as the client can tell."""

    member: bool  # joined and stable (heartbeats flowing)
    out_for_s: float  # seconds since it last was a member (0 while it is one)
    losses: int  # times the watchdog found the group had dropped it without the client noticing
    stalls: int = 0  # partitions the client stopped fetching that had to be positioned again (stalls.py)


class GroupConsumer:
    def __init__(
        self,
        conn: KafkaConnection,
        group_id: str,
        topics: Sequence[str] | str,
        client_id: str,
        max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED,
    ) -> None:
        """`topics`: the topics to read, or one regex of them (topics made later are read too, from the
        next metadata refresh: within PATTERN_REFRESH_MS)."""
        self._events: queue.Queue[RebalanceEvent] = queue.Queue()
        self._committed: queue.Queue[dict[Partition, int]] = queue.Queue()
        self._commit_lock = threading.Lock()
        self._commit_in_flight = False
        self._positions: dict[Partition, int] = {}  # next offset to read, as far as poll() returned
        self._consumer = KafkaConsumer(
            **conn.client_options(),
            group_id=group_id,
            client_id=client_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=MAX_POLL_RECORDS,
            # a generation step is short, but a slow first model load must not cost the membership
            max_poll_interval_ms=300_000,
            session_timeout_ms=SESSION_TIMEOUT_MS,
            heartbeat_interval_ms=2_000,
            partition_assignment_strategy=(CooperativeStickyAssignor,),
            metadata_max_age_ms=PATTERN_REFRESH_MS if isinstance(topics, str) else 300_000,
        )
        guard(self._consumer, max_decompressed_bytes)
        self.stalls = StallWatch(self._consumer)
        # topics paused on request (`pause`), whatever the assignment; replaced, never changed in place:
        # the listener reads it on the client's I/O thread
        self._held: frozenset[str] = frozenset()
        self._losses = 0
        self._member_since: float | None = None  # monotonic time it last became a stable member
        self._out_since = time.monotonic()
        if isinstance(topics, str):
            self._consumer.subscribe(pattern=topics, listener=_Listener(self._events, self._hold_assigned))
        else:
            self._consumer.subscribe(list(topics), listener=_Listener(self._events, self._hold_assigned))

    # ---- records --------------------------------------------------------------------------------
    def poll(
        self, timeout_s: float, max_records: int | None = None, first: Callable[[str], bool] | None = None
    ) -> list[Record]:
        """Records fetched since the last poll, at most `max_records`. `first`: topics whose records are
        handed out before any other's. kafka-python hands out all of one partition's buffered records
        before it looks at any other fetched partition (and fetches nothing while others wait to be
        handed out), so a backlog buffered from one topic would hold back a record of another posted after
        it; the other partitions are paused for a first poll that takes only what `first` topics have."""
        self._apply_holds()
        if first is not None:
            records = self._poll_first(first, max_records)
            if records:
                return records
        records = self._poll(timeout_s, max_records)
        try:
            self.stalls.observe(records, short=len(records) < (max_records or MAX_POLL_RECORDS))
        except Exception:  # noqa: BLE001 - the records are read (their positions moved): never lose them
            log.exception("partition stall watchdog failed; going on")
        return records

    def _poll_first(self, first: Callable[[str], bool], max_records: int | None) -> list[Record]:
        paused = self._consumer.paused()
        others = [tp for tp in self._consumer.assignment() if not first(tp.topic) and tp not in paused]
        if not others:
            return []  # nothing to hold back: the one poll does
        self._consumer.pause(*others)
        try:
            return self._poll(0.0, max_records)
        finally:
            # a rebalance inside the poll may have taken some of them: resume only what is still ours
            assigned = self._consumer.assignment()
            self._consumer.resume(*(tp for tp in others if tp in assigned))

    def _poll(self, timeout_s: float, max_records: int | None) -> list[Record]:
        self._unpark_resumed()
        self._check_membership()
        try:
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except Exception as exc:  # noqa: BLE001 - broker, group or record trouble: the worker goes on
            records = recover(self._consumer, exc, "group consumer")
            records = [replace(r, generation=self.generation()) for r in records]
        else:
            generation = self.generation()  # after the poll: rebalance callbacks run inside it
            records = [to_record(r, generation) for rs in batches.values() for r in rs]
        owned = self.assignment()
        records = [r for r in records if r.source in owned]  # a partition revoked meanwhile is not ours
        for r in records:
            self._positions[r.source] = max(self._positions.get(r.source, 0), r.next_offset)
        return records

    def _unpark_resumed(self) -> None:
        """Work around kafka-python 3.0 losing resumed partitions for good.

        Records fetched for a partition while it was paused are parked, and the partition is not fetched
        again until they are handed back. The fetcher hands them back only when its in-line slot is None,
        but a drained slot stays a (falsy) records object, so after pause → resume the partition is never
        read again: the worker stalls on a backlog. A drained slot and None mean the same to the fetcher.
        """
        fetcher = getattr(self._consumer, "_fetcher", None)
        parked = fetcher is not None and getattr(fetcher, "_paused_partition_records", None)
        if parked and not fetcher._next_partition_records:
            fetcher._next_partition_records = None

    # ---- group ----------------------------------------------------------------------------------
    def generation(self) -> int:
        """The group generation this member is in (0 while it is in none): records fetched under it carry
        it, so a late write of a member that lost a partition can be told from the new owner's."""
        coordinator = getattr(self._consumer, "_coordinator", None)
        generation = getattr(coordinator, "_generation", None)
        return max(0, getattr(generation, "generation_id", 0) or 0)

    def membership(self) -> Membership:
        stable = self._stable()
        now = time.monotonic()
        if stable:
            self._out_since = now
        return Membership(stable, 0.0 if stable else now - self._out_since, self._losses, self.stalls.healed)

    def _stable(self) -> bool:
        coordinator = getattr(self._consumer, "_coordinator", None)
        return coordinator is not None and coordinator.state is MemberState.STABLE and self.generation() > 0

    def _check_membership(self) -> None:
        """Rejoin when the group has surely dropped this member while the client still thinks it is in.

        kafka-python learns that it left the group only from a heartbeat's answer. If its heartbeat loop
        dies or stalls (it was seen under load: no revoke, no new assignment, a new tenant's topic never
        read), the coordinator expels the member after a session timeout while the client keeps fetching
        as if nothing happened. No answered heartbeat for a whole session while the coordinator is
        reachable means the broker has expelled it: say so, drop the generation (the next poll fires
        `on_partitions_lost`, so the worker releases its jobs) and join again.
        """
        coordinator = getattr(self._consumer, "_coordinator", None)
        if coordinator is None or not self._stable():
            return
        heartbeat = coordinator.heartbeat
        silent_s = time.monotonic() - max(heartbeat.last_receive, heartbeat.last_reset)
        if silent_s <= SESSION_TIMEOUT_MS / 1000:
            return
        node = coordinator.coordinator_id
        if node is None or not self._consumer._client.connected(node):
            return  # the broker is away: its own recovery (and the heartbeat's) covers that
        self._losses += 1
        log.warning(
            "consumer group %s: no heartbeat answered for %.1f s while the coordinator is reachable; "
            "the group has dropped this member: releasing its partitions and rejoining",
            coordinator.group_id,
            silent_s,
        )
        coordinator.reset_generation()

    def rebalances(self) -> list[RebalanceEvent]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def assignment(self) -> set[Partition]:
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def seek(self, partition: Partition, offset: int) -> None:
        self._consumer.seek(TopicPartition(*partition), offset)
        self._positions[partition] = offset

    def pause(self, topics: Iterable[str]) -> None:
        """Hold these topics: every partition of them this member owns, now or after a rebalance, stays
        paused until `resume`."""
        self._held = self._held | set(topics)
        self._apply_holds()

    def resume(self, topics: Iterable[str]) -> None:
        self._held = self._held - set(topics)
        self._apply_holds()

    @property
    def holding(self) -> bool:
        """Some topics are held (`pause`)."""
        return bool(self._held)

    def _hold_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        held = self._held
        parts = [tp for tp in assigned if tp.topic in held]
        if parts:
            self._consumer.pause(*parts)

    def _apply_holds(self) -> None:
        """Make the client's paused partitions match the held topics. The client pauses partitions, not
        topics, and a partition assigned later starts unpaused while one kept through a cooperative
        rebalance stays as it was; applied before every poll, a held topic can never have a partition
        read, nor a released one a partition left paused for good."""
        assigned, paused = self._consumer.assignment(), self._consumer.paused()
        hold = [tp for tp in assigned if tp.topic in self._held and tp not in paused]
        release = [tp for tp in paused if tp.topic not in self._held and tp in assigned]
        if hold:
            self._consumer.pause(*hold)
        if release:
            self._consumer.resume(*release)

    def lag(self) -> dict[Partition, int]:
        """Records not yet read per owned partition (from the last fetch's high watermark)."""
        out = {}
        for tp in self._consumer.assignment():
            high = self._consumer.highwater(tp)
            if high is not None:
                out[(tp.topic, tp.partition)] = max(
                    0, high - self._positions.get((tp.topic, tp.partition), high)
                )
        return out

    # ---- offsets --------------------------------------------------------------------------------
    def commit(self, offsets: dict[Partition, int]) -> bool:
        """Start an asynchronous commit of next-offsets to read; False if one is still under way.

        Offsets that reached the broker come back from `committed()`; a failed commit is simply retried
        by the caller with newer offsets (the group moved on: the new owner redoes the rest).
        """
        if not offsets:
            return True
        with self._commit_lock:
            if self._commit_in_flight:
                return False
            self._commit_in_flight = True
        payload = {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()}
        sent = dict(offsets)

        def done(_offsets, response) -> None:
            with self._commit_lock:
                self._commit_in_flight = False
            if isinstance(response, BaseException):
                log.warning("offset commit failed (%s); will retry", response)
            else:
                self._committed.put(sent)

        try:
            self._consumer.commit_async(payload, callback=done)
        except Exception as exc:  # noqa: BLE001 - e.g. no coordinator while the broker is away
            with self._commit_lock:
                self._commit_in_flight = False
            log.warning("offset commit not sent (%s); will retry", exc)
        return True

    def committed(self) -> list[dict[Partition, int]]:
        out = []
        while True:
            try:
                out.append(self._committed.get_nowait())
            except queue.Empty:
                return out

    def commit_sync(self, offsets: dict[Partition, int], timeout_s: float = 10.0) -> bool:
        """A blocking commit, for shutdown."""
        payload = {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()}
        try:
            self._consumer.commit(payload, timeout_ms=int(timeout_s * 1000))
            return True
        except Exception as exc:  # noqa: BLE001
            log.warning("final offset commit failed (%s); uncommitted jobs will be redelivered", exc)
            return False

    def close(self) -> None:
        try:
            self._consumer.close(autocommit=False)
        except Exception as exc:  # noqa: BLE001 - closing while the broker is away
            log.warning("consumer close: %s", exc)
