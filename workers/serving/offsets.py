"""Offset bookkeeping: commit only the unbroken run of finished offsets per partition.

Track offsets as records arrive, ack them when their job is terminal in Postgres (or rejected); the
committable offset of a partition is one past the last offset of the unbroken acked run from the start
(acked 34 35 36 40 with 37 pending → commit 37). Everything after it is redelivered on a restart and
de-duplicated by the jobs table.
"""

from __future__ import annotations

from collections.abc import Iterable

from workers.kafka_io import Partition


class OffsetTracker:
    def __init__(self) -> None:
        self._pending: dict[Partition, set[int]] = {}  # tracked, not yet acked
        self._high: dict[Partition, int] = {}  # highest offset tracked
        self._committed: dict[Partition, int] = {}

    def track(self, partition: Partition, offset: int, last_offset: int | None = None) -> None:
        """`last_offset`: the record stands for offsets `offset`..`last_offset` (an undecodable batch);
        acking `offset` then finishes them all."""
        self._pending.setdefault(partition, set()).add(offset)
        high = offset if last_offset is None else max(offset, last_offset)
        self._high[partition] = max(high, self._high.get(partition, high))

    def ack(self, partition: Partition, offset: int) -> None:
        pending = self._pending.get(partition)
        if pending is not None:
            pending.discard(offset)  # unknown offsets (revoked partition, second ack) are ignored

    def safe_offset(self, partition: Partition) -> int:
        # Gaps the consumer never delivered (compaction, transaction markers) must not block the run,
        # so the bound is the lowest pending offset, not the lowest unseen one.
        pending = self._pending[partition]
        return min(pending) if pending else self._high[partition] + 1

    def committable(self) -> dict[Partition, int]:
        """Partitions whose safe offset moved since the last `committed` call."""
        safe = {p: self.safe_offset(p) for p in self._pending}
        return {p: o for p, o in safe.items() if self._committed.get(p) != o}

    def committed(self, offsets: dict[Partition, int]) -> None:
        self._committed.update(offsets)

    def pending(self, partition: Partition) -> int:
        return len(self._pending.get(partition, ()))

    def forget(self, partitions: Iterable[Partition]) -> None:
        """Drop revoked partitions: their new owner resumes from the last commit."""
        for p in partitions:
            for table in (self._pending, self._high, self._committed):
                table.pop(p, None)
