"""A watchdog for partitions the client stops delivering: assigned, not paused, records waiting, and yet
poll after poll hands out none of them.

kafka-python 3.0 keeps per-partition fetch state in several places (the position and its reset and
validation flags, records parked while paused, the fetcher's in-line slot). When one of them is left in
a wrong state the partition is simply never fetched again: no error, no log, a backlog that waits
forever while the worker idles (seen as a restarted worker that never read one partition's backlog).
The watchdog notices it from outside (nothing of that partition across many polls that returned less
than they could, for a while), logs the client's state for that partition, and puts the partition back
on a clean footing: its parked records are dropped and it is positioned again where it stood (or, with
no position, at the group's committed offset, or per the reset policy), which is what a restart does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from kafka import KafkaConsumer, TopicPartition

from workers.kafka_io.records import Record

log = logging.getLogger(__name__)

STALL_S = 30.0  # how long a partition may yield nothing while records wait for it
STALL_POLLS = 20  # ...across at least this many polls that returned less than they were allowed


class StallWatch:
    def __init__(self, consumer: KafkaConsumer, stall_s: float = STALL_S, polls: int = STALL_POLLS) -> None:
        self._consumer = consumer
        self._stall_s = stall_s
        self._polls = polls
        self._since: dict[TopicPartition, tuple[float, int]] = {}  # waiting since (time, short polls)
        self.healed = 0  # partitions put back on their feet, for metrics and tests

    def observe(self, records: Iterable[Record], short: bool) -> None:
        """After each poll: `short` when it returned fewer records than it was allowed (the client had no
        more to hand out right then)."""
        now = time.monotonic()
        delivered = {r.source for r in records}
        subscription = self._consumer._subscription
        for tp, state in list(subscription.assignment.items()):
            if (tp.topic, tp.partition) in delivered or state.paused or not _waiting(state):
                self._since.pop(tp, None)
                continue
            since, polls = self._since.get(tp, (now, 0))
            polls += int(short)
            self._since[tp] = (since, polls)
            if now - since >= self._stall_s and polls >= self._polls:
                self._heal(tp, state, now - since, polls)
                self._since.pop(tp, None)
        for tp in [tp for tp in self._since if tp not in subscription.assignment]:
            del self._since[tp]

    def _heal(self, tp: TopicPartition, state, stalled_s: float, polls: int) -> None:
        fetcher = self._consumer._fetcher
        slot = fetcher._next_partition_records
        log.warning(
            "partition %s:%d has records waiting but none came in %.0f s (%d polls); the client's state: "
            "%s; parked: %s, parked raw: %s, in-line slot: %s, completed fetches: %s; positioning it again",
            tp.topic,
            tp.partition,
            stalled_s,
            polls,
            vars(state),
            tp in fetcher._paused_partition_records,
            tp in fetcher._paused_completed_fetches,
            getattr(slot, "topic_partition", None),
            [c.topic_partition for c in list(fetcher._completed_fetches)],
        )
        parked = fetcher._paused_partition_records.pop(tp, None)
        if parked is not None:
            parked.drain()
        fetcher._paused_completed_fetches.pop(tp, None)
        if slot is not None and getattr(slot, "topic_partition", None) == tp:
            slot.drain()
            fetcher._next_partition_records = None
        # between polls no revocation callback runs: a partition still assigned is not being revoked
        state.mark_pending_revocation(False)
        offset = state.position.offset if state.has_valid_position else self._committed(tp)
        if offset is None:
            self._consumer._subscription.request_offset_reset(tp)
        else:
            self._consumer.seek(tp, offset)
        self.healed += 1

    def _committed(self, tp: TopicPartition) -> int | None:
        try:
            committed = self._consumer.committed(tp)
        except Exception as exc:  # noqa: BLE001 - no coordinator now: the reset policy decides
            log.warning("committed offset of %s:%d unknown (%s)", tp.topic, tp.partition, exc)
            return None
        return committed


def _waiting(state) -> bool:
    """Records wait for this partition: its position is unknown (never fetched, or lost), or behind the
    last high watermark the broker reported."""
    if not state.has_valid_position or state.highwater is None:
        return True
    return state.position.offset < state.highwater
