"""Job-row writes as items: each idempotent, each yielding the rows whose results must be published.

The persister first applies a batch of items as one transaction; when PostgreSQL refuses something in
it, each item is applied alone, and an item refused by itself is recorded in the simplest form that can
be stored (`fallback`: a `failed` row with the reason), so one bad value never holds back the others.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Protocol

from schemas.job_key import JobKey
from schemas.jobs import JobResult
from workers.db import Connection, Row
from workers.db.jobs import (
    Terminal,
    fail,
    finish,
    finish_many,
    mark_running,
    request_cancel,
    superseded_by,
)
from workers.db.outbox import claim, take_over
from workers.db.progress import ProgressChunk, drop_progress, save_progress
from workers.kafka_io import Coordinates, Record
from workers.serving.errors import describe_error
from workers.serving.outbox.delivery import Waitable

log = logging.getLogger(__name__)

Source = Coordinates  # the record a write settles


def storable(text: str) -> str:
    """PostgreSQL text cannot hold U+0000; such characters are stored as U+FFFD."""
    return text.replace("\x00", "\ufffd")


@dataclass
class Stored:
    """What writes produced: results to publish, and which of them are outbox rows."""

    outbox: list[Row] = field(default_factory=list)  # publish (this worker holds the lease), then mark
    direct: list[JobResult] = field(default_factory=list)  # publish only (there is no row of ours)
    deferred: list[Any] = field(default_factory=list)  # items to try again later (not acked meanwhile)
    unsure: set[JobKey] = field(default_factory=set)  # outbox jobs whose result may be out already
    # items of an attempt a later one replaced, each with the record that later attempt runs from:
    # nothing is written; the item's other records are acked (that run concludes the job), but never
    # that record (its offset belongs to the job's new owner, which may be this worker again)
    superseded: list[tuple[Any, Source]] = field(default_factory=list)

    def __iadd__(self, other: Stored) -> Stored:
        self.outbox += other.outbox
        self.direct += other.direct
        self.deferred += other.deferred
        self.unsure |= other.unsure
        self.superseded += other.superseded
        return self


@dataclass(frozen=True)
class WriteContext:
    worker_id: str
    now: datetime

    @property
    def claim(self) -> dict[str, Any]:
        """Written with every terminal row: this worker publishes its result (see outbox.py)."""
        return claim(self.worker_id, self.now)


class WriteItem(Protocol):
    sources: tuple[Source, ...]  # Kafka records to ack once this item is stored and its result published

    def apply(self, conn: Connection, ctx: WriteContext) -> Stored: ...

    def fallback(self, conn: Connection, ctx: WriteContext, error: str) -> Stored: ...


def apply_all(conn: Connection, items: list[WriteItem], ctx: WriteContext) -> Stored:
    """Every item in order, in one transaction. Consecutive `Running` and `Concluded` items go as one
    statement for the starts, then one for the terminal rows (per set of columns): set-based, so a flush
    of a thousand finished jobs is a few round trips, not a thousand. (Within such a run a job's start
    comes before its end, as submitted; the fences make every other order within it equivalent.) Every
    `Progress` chunk of the batch goes first, as one statement: a save is fenced by its attempt, which
    nothing else in a batch moves on, and a job's terminal row, later, deletes what it saved."""
    out = Stored()
    save_progress(conn, [c for item in items if isinstance(item, Progress) for c in item.chunks], ctx.now)
    run: list[Running | Concluded] = []
    for item in items:
        if isinstance(item, Progress):
            continue
        if isinstance(item, Running | Concluded):
            run.append(item)
            continue
        _apply_run(conn, run, ctx, out)
        run = []
        out += item.apply(conn, ctx)
    _apply_run(conn, run, ctx, out)
    return out


def _apply_run(conn: Connection, run: list[Running | Concluded], ctx: WriteContext, out: Stored) -> None:
    # A start whose attempt ends in the same run is not written on its own: the terminal row carries its
    # started_at, and the terminal fence (that attempt, not terminal) admits a queued row as well as a
    # running one. A short job is then one row version (and its index entries) fewer: most of
    # PostgreSQL's work for it.
    ends = {(i.row.tenant, i.row.job_id, i.row.attempt): i for i in run if isinstance(i, Concluded)}
    starts: list[tuple[str, str, datetime, int]] = []
    started_at: dict[int, datetime] = {}  # id of a Concluded item -> its attempt's start, written with it
    for i in run:
        if isinstance(i, Running):
            end = ends.get((i.tenant, i.job_id, i.attempt))
            if end is None:
                starts.append((i.tenant, i.job_id, i.at, i.attempt))
            else:
                started_at.setdefault(id(end), i.at)
    mark_running(conn, starts)
    if ends:
        concluded = [i for i in run if isinstance(i, Concluded)]
        rows = [i.claimed(ctx, started_at.get(id(i))) for i in concluded]
        written_rows = finish_many(conn, rows, ctx.now)
        ended = zip(concluded, written_rows, strict=True)
        drop_progress(conn, [i.row.key for i, w in ended if i.progress and w is not None])
        for item, written in zip(concluded, written_rows, strict=True):
            out += item._outcome(conn, written, dropped=True)


class _NoFallback:
    """Items with nothing simpler to store: when refused, they are logged and dropped."""

    def fallback(self, conn: Connection, ctx: WriteContext, error: str) -> Stored:
        return Stored()


def outbox_row(row: Row | None) -> Stored:
    """What an item that wrote (or found) one terminal row produced: that row to publish, if any."""
    return Stored(outbox=[row] if row is not None else [])


@dataclass(frozen=True)
class Running(_NoFallback):
    job_id: str
    at: datetime
    attempt: int
    sources: tuple[Source, ...] = ()
    tenant: str = "default"

    def apply(self, conn: Connection, ctx: WriteContext) -> Stored:
        mark_running(conn, [(self.tenant, self.job_id, self.at, self.attempt)])
        return Stored()


@dataclass(frozen=True)
class Concluded:
    """The terminal row of an attempt this worker ran."""

    row: Terminal
    sources: tuple[Source, ...]
    # the attempt's last token event: the row is written once the broker has it, so a job that is
    # terminal has its whole stream on the tokens topic (unless the broker stayed away past the wait)
    stream_end: Waitable | None = None
    progress: bool = False  # the job has saved progress (job_progress rows) to delete with this row

    def apply(self, conn: Connection, ctx: WriteContext) -> Stored:
        return self._outcome(conn, finish(conn, self.claimed(ctx), ctx.now))

    def claimed(self, ctx: WriteContext, started_at: datetime | None = None) -> Terminal:
        """The row with this worker's claim on publishing its result (and `started_at` when the row has
        none: its start was not written on its own)."""
        values = {**self.row.values, **ctx.claim}
        if started_at is not None and values.get("started_at") is None:
            values["started_at"] = started_at
        return replace(self.row, values=values)

    def fallback(self, conn: Connection, ctx: WriteContext, error: str) -> Stored:
        reason = storable(f"result could not be stored: {error}")
        r = self.row
        written = fail(conn, r.tenant, r.job_id, reason, ctx.now, ctx.claim, r.attempt)
        return self._outcome(conn, written)

    def _outcome(self, conn: Connection, written: Row | None, dropped: bool = False) -> Stored:
        r = self.row
        if written is not None and self.progress and not dropped:  # (apply_all drops a run's at once)
            drop_progress(conn, [r.key])
        if written is None and (later := superseded_by(conn, r.tenant, r.job_id, r.attempt)):
            return Stored(superseded=[(self, later)])
        return outbox_row(written)


class DeadLettered:
    """A write item whose record can never run: the persister dead-letters that record before it stores
    anything (intake's `Rejected` is the one kind; the outbox sees only this much of it)."""

    record: Record
    job_id: str  # "" when the record names no job (a control message)


@dataclass(frozen=True)
class Progress(_NoFallback):
    """Running jobs' tokens since their last save (workers/db/progress.py): kept only while each job's
    row is still that attempt's. Acks no record: the job's own conclusion does."""

    chunks: tuple[ProgressChunk, ...]
    sources: tuple[Source, ...] = ()

    def apply(self, conn: Connection, ctx: WriteContext) -> Stored:
        save_progress(conn, self.chunks, ctx.now)
        return Stored()


@dataclass(frozen=True)
class CancelRequested(_NoFallback):
    """A tenant's cancel, recorded durably (a `cancelled` row if nobody has the job yet)."""

    job_id: str
    tenant: str
    at: datetime
    sources: tuple[Source, ...] = ()  # the control record, when this worker owns the control partition

    def apply(self, conn: Connection, ctx: WriteContext) -> Stored:
        values = ctx.claim
        if self.sources:  # a `cancelled` row's source is its control record (the sweeper finds it by it)
            topic, partition, offset = self.sources[0]
            values = {**values, "source_topic": topic, "source_partition": partition, "source_offset": offset}
        return outbox_row(request_cancel(conn, self.job_id, self.tenant, self.at, ctx.worker_id, values))


@dataclass(frozen=True)
class Republish(_NoFallback):
    """A redelivered job that is terminal already: its result goes out again only if it never did, and
    only once its publisher's lease has lapsed (a live publisher, e.g. one waiting out a broker outage,
    publishes it itself: this item waits and is acked when that is done)."""

    job_id: str
    sources: tuple[Source, ...]
    tenant: str = "default"

    def apply(self, conn: Connection, ctx: WriteContext) -> Stored:
        key = JobKey(self.tenant, self.job_id)
        state, row = take_over(conn, key, ctx.worker_id, ctx.now)
        if state == "taken":  # its publisher may have died after the broker took the result
            return Stored(outbox=[row], unsure={key})
        return Stored(deferred=[self]) if state == "held" else Stored()


def await_stream_ends(items: Sequence[object], timeout_s: float) -> None:
    """Wait (bounded in all) for the last token events some items carry; a failure is only logged."""
    deadline = time.monotonic() + timeout_s
    for item in items:
        end = getattr(item, "stream_end", None)
        if end is None:
            continue
        try:
            end.wait(max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - the result must not wait on the stream forever
            log.warning(
                "the last token event of %s was not confirmed: %s", describe_item(item), describe_error(exc)
            )


def job_of(item: object) -> JobKey | None:
    """(tenant, job_id) of the job an item writes (None for a record without one)."""
    row = getattr(item, "row", None)
    if row is not None:
        return row.key
    job_id = getattr(item, "job_id", None)
    return JobKey(getattr(item, "tenant", "default"), job_id) if job_id else None


def describe_item(item: object) -> str:
    key = job_of(item)
    return f"{type(item).__name__.lower()} of job {describe_key(key) if key else '?'}"


def describe_key(key: JobKey) -> str:
    """A job for the log: its id, and its tenant when that is not the default one."""
    tenant, job_id = key
    return job_id if tenant == "default" else f"{job_id} (tenant {tenant})"
