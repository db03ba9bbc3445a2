"""A record that can never run, as intake (or admission) decided it: a write item that stores a
`rejected` row when its id is free, and whose record goes to the dead-letter topic first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schemas.jobs import JobResult
from workers.db import Connection
from workers.db.jobs import insert_terminal, reject_admitted
from workers.kafka_io import Record
from workers.serving.outbox.writes import DeadLettered, Source, Stored, WriteContext, outbox_row, storable


@dataclass(frozen=True)
class Rejected(DeadLettered):
    """A record that can never run: dead-lettered, with a `rejected` row when its id is free."""

    record: Record
    job_id: str
    tenant: str
    priority: str
    error: str
    reason: str  # a short category for metrics: invalid, too_long, wrong_tenant, unstorable, ...
    store_row: bool = True  # False when there is no job row to write (a control message)
    announce: bool = True  # publish a `rejected` result (False for control messages: no job to report)
    model: str | None = None  # the model the job named, when it was read

    @property
    def sources(self) -> tuple[Source, ...]:
        return ((self.record.topic, self.record.partition, self.record.offset),)

    def apply(self, conn: Connection, ctx: WriteContext) -> Stored:
        if not self.store_row:
            return Stored(direct=[self.result()] if self.announce else [])
        # an id that already has a row keeps it: that row speaks for the id, unless this very record
        # was admitted before (a verdict that changed: an adapter removed since): its live row ends here
        values = self._values(ctx)
        row = insert_terminal(conn, self.tenant, self.job_id, "rejected", values)
        if row is None:
            row = reject_admitted(conn, self.tenant, self.job_id, self.record.coordinates, values)
        return outbox_row(row)

    def fallback(self, conn: Connection, ctx: WriteContext, error: str) -> Stored:
        values = {
            **self._values(ctx),
            "prompt": None,
            "error": storable(f"{self.error}; not stored: {error}"),
        }
        return outbox_row(insert_terminal(conn, self.tenant, self.job_id, "rejected", values))

    def _values(self, ctx: WriteContext) -> dict[str, Any]:
        rec = self.record
        return {
            **ctx.claim,
            "priority": self.priority,
            "error": storable(self.error),
            "finish_reason": "rejected",
            "created_at": rec.posted_at(ctx.now),
            "finished_at": ctx.now,
            "updated_at": ctx.now,
            "prompt": storable((rec.value or b"")[:4096].decode("utf-8", "replace")),
            "source_topic": rec.topic,
            "source_partition": rec.partition,
            "source_offset": rec.offset,
            "worker_id": ctx.worker_id,
            "model": self.model,
        }

    def result(self) -> JobResult:
        return JobResult(
            job_id=self.job_id,
            status="rejected",
            tenant=self.tenant,
            priority=self.priority,
            finish_reason="rejected",
            error=self.error,
        )
