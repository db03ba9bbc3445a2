"""The outbox sweeper: publishes results whose rows are terminal, unpublished, and without a live publisher.

Without it such a result would go out only when its record is read again: for a committed record never
(say marking a published result failed for good after its record was acked), for an uncommitted one only
after a restart or a rebalance. Every worker sweeps its deployment's rows every `interval_s`, a bounded
batch at a time (a full batch is followed at once by the next); claims skip rows another worker is
claiming and take only lapsed leases, so a live publisher (one riding out a broker outage) keeps its rows.
A claimed row's result is looked for in the topic before it is sent (its dead publisher may have sent it),
as on any take-over.

It runs on the persister's storing thread, between batches, and publishes only while its publishing thread
does not (one lock): that keeps it off the engine loop's thread, and a row is never published by the
sweeper and a redelivery of its record at the same time in one worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from workers.clock import utcnow
from workers.db import Engine, Row
from workers.db.outbox import claim_lapsed
from workers.serving.errors import describe_error

log = logging.getLogger(__name__)

SWEEP_S = 10.0  # between sweeps
SWEEP_BATCH = 100  # rows claimed per sweep
SWEEP_BUDGET_S = 20.0  # the longest a sweep publishes before the persister's own work goes on

# publishes claimed rows (claimed at a monotonic time) until a monotonic deadline
Publish = Callable[[list[Row], float, float], object]


class Sweeper:
    def __init__(
        self,
        engine: Engine,
        worker_id: str,
        source_topics: Sequence[str],
        publish: Publish,
        interval_s: float = SWEEP_S,
        batch: int = SWEEP_BATCH,
        budget_s: float = SWEEP_BUDGET_S,
        source_prefix: str | None = None,
    ) -> None:
        self._engine = engine
        self._worker_id = worker_id
        self._sources = tuple(source_topics)  # the deployment's topics: its rows' source topics
        self._source_prefix = source_prefix  # per-tenant topics: whichever tenant topics exist
        self._publish = publish
        self._interval_s = interval_s
        self._batch = batch
        self._budget_s = budget_s
        self._next = 0.0  # a worker sweeps as it starts: its dead predecessor's rows go out first

    def wait_s(self) -> float:
        """Seconds until the next sweep is due."""
        return max(0.0, self._next - time.monotonic())

    def sweep_if_due(self) -> None:
        if time.monotonic() < self._next:
            return
        rows: list[Row] = []
        try:
            claimed = time.monotonic()
            with self._engine.begin() as conn:
                rows = claim_lapsed(
                    conn, self._worker_id, utcnow(), self._sources, self._batch, self._source_prefix
                )
            if rows:
                log.info("publishing %d results whose publisher is gone", len(rows))
                self._publish(rows, claimed, claimed + self._budget_s)
        except Exception as exc:  # noqa: BLE001 - e.g. the database is away: the next sweep tries again
            log.warning("sweeping unpublished results failed: %s", describe_error(exc))
            rows = []
        full = len(rows) == self._batch
        self._next = time.monotonic() + (0.0 if full else self._interval_s)
