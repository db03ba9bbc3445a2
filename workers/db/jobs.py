"""The jobs table: idempotent writes keyed by (job_id, tenant). A terminal row is never overwritten.

Job ids are scoped by tenant: every statement names the tenant with the id, so two tenants' jobs with the
same id are two rows that never touch, and a cancel only ever reaches its own tenant's row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any, Literal

from sqlalchemy import BindParameter, Connection, Row, Update, bindparam, select, text
from sqlalchemy.dialects.postgresql import insert

from schemas.job_key import JobKey  # (tenant, job_id): what names one job
from schemas.tables import TERMINAL_STATUSES, jobs
from schemas.topics import Coordinates
from workers.db.progress import SavedProgress
from workers.db.sets import KEYS, KEYS_MATCH, array_type, arrays, key_arrays, unnest

# What a person listing jobs wants to see first (`inferq jobs`, the demo).
# how long an attempt admitted in a later group generation is protected from a late admission
GENERATION_FENCE = timedelta(minutes=10)
SUMMARY_COLUMNS = (
    jobs.c.job_id,
    jobs.c.tenant,
    jobs.c.priority,
    jobs.c.status,
    jobs.c.finish_reason,
    jobs.c.prompt_tokens,
    jobs.c.completion_tokens,
    jobs.c.ttft_ms,
    jobs.c.mean_itl_ms,
    jobs.c.e2e_ms,
)


@dataclass(frozen=True)
class Admission:
    """A job taken off Kafka by this worker."""

    job_id: str
    tenant: str
    priority: str
    prompt: str
    params: dict[str, Any]
    bulk_id: str | None
    created_at: datetime
    queued_at: datetime
    worker_id: str
    source: Coordinates
    generation: int = 0  # the consumer-group generation the record was fetched in (0: not known)
    model: str | None = None  # the model that serves it: the base's name or the adapter's


@dataclass(frozen=True)
class Admitted:
    """What admission found for one job.

    start: run it now as `attempt`; done: already terminal (`published` says whether its result went out);
    cancelled: a cancel arrived before it could start;
    held: this worker runs the job already (a duplicate message), so nothing was written;
    superseded: a worker that fetched the job in a later group generation runs it (this admission came late).
    """

    kind: Literal["start", "done", "cancelled", "held", "superseded"]
    attempt: int = 0
    published: bool = True
    seed: int | None = None  # start: the seed stored with the job (every attempt samples with it)
    progress: SavedProgress | None = None  # start: what earlier attempts saved (workers/db/progress.py)


@dataclass(frozen=True)
class Terminal:
    """The final state of one attempt of a job."""

    job_id: str
    status: str
    values: dict[str, Any] = field(default_factory=dict)  # output_text, finish_reason, usage, timings, error
    # the attempt that ended: its row is written only while no later attempt has re-queued the job (a
    # fencing token); None for a job that never ran (cancelled before it started)
    attempt: int | None = None
    tenant: str = "default"

    @property
    def key(self) -> JobKey:
        return JobKey(self.tenant, self.job_id)


def admit(conn: Connection, rows: Sequence[Admission]) -> dict[JobKey, Admitted]:
    """Insert or re-queue jobs (one statement), then classify those that could not be (re)queued; by
    (tenant, job_id)."""
    if not rows:
        return {}
    params = arrays(_QUEUED_FIELDS, [_queued_row(r) for r in rows])
    params["fence"] = GENERATION_FENCE
    outcome = {
        (tenant, job_id): Admitted("start", n, seed=seed)
        for tenant, job_id, n, seed in conn.execute(_ADMIT, params)
    }
    missing = [(r.tenant, r.job_id) for r in rows if (r.tenant, r.job_id) not in outcome]
    if missing:
        for row in conn.execute(_CLASSIFY, key_arrays(missing)):
            key = (row.tenant, row.job_id)
            if row.status in TERMINAL_STATUSES:
                outcome[key] = Admitted("done", published=row.published_at is not None)
            elif row.cancel_requested_at is not None:
                outcome[key] = Admitted("cancelled")
            else:
                outcome[key] = Admitted("superseded")
    if len(outcome) < len(rows):  # a row deleted between the two statements (retention): try again
        outcome.update(admit(conn, [r for r in rows if (r.tenant, r.job_id) not in outcome]))
    return outcome


_QUEUED_COLUMNS = (
    "job_id", "tenant", "priority", "prompt", "params", "bulk_id", "created_at", "queued_at", "worker_id",
    "source_topic", "source_partition", "source_offset", "admitted_generation", "model",
)  # fmt: skip
_QUEUED_FIELDS = tuple((name, array_type(jobs.c[name])) for name in _QUEUED_COLUMNS)
_TERMINAL_SQL = ", ".join(f"'{s}'" for s in TERMINAL_STATUSES)
# The job's sampling seed is in its params from its first admission on (the posted one, or one drawn then;
# a row written before seeds were stored gets this admission's): every attempt samples with the same one.
# One statement for any number of jobs: the upsert that re-queues a job unless it is terminal, cancelled,
# or has a newer owner: its attempt was admitted in a later group generation than this admission's record,
# lately, by another worker (the record's partition has moved on, and its new owner runs the job). A
# generation older than the fence's window is not trusted: a group that was deleted and made again counts
# from 0. An attempt this same worker admitted is no other owner's: the worker admits only what it does not
# run (a job it runs is held before any write), so that attempt was dropped here (aborted without a row)
# and this copy re-admits the job rather than wait for a run that nobody does.
_ADMIT = text(
    f"""INSERT INTO jobs ({", ".join(_QUEUED_COLUMNS)}, status, attempts)
SELECT v.*, 'queued', 1 FROM {unnest(_QUEUED_FIELDS)}
ON CONFLICT (job_id, tenant) DO UPDATE SET status = 'queued', attempts = jobs.attempts + 1,
  worker_id = excluded.worker_id, queued_at = excluded.queued_at, source_topic = excluded.source_topic,
  source_partition = excluded.source_partition, source_offset = excluded.source_offset,
  updated_at = excluded.queued_at, admitted_generation = excluded.admitted_generation, model = excluded.model,
  params = CASE WHEN jobs.params ->> 'seed' IS NULL AND excluded.params ->> 'seed' IS NOT NULL
    THEN jsonb_set(coalesce(jobs.params, '{{}}'), '{{seed}}', excluded.params -> 'seed') ELSE jobs.params END
WHERE jobs.status NOT IN ({_TERMINAL_SQL}) AND jobs.cancel_requested_at IS NULL
  AND NOT (jobs.admitted_generation > excluded.admitted_generation
           AND jobs.updated_at > excluded.queued_at - CAST(:fence AS interval)
           AND jobs.worker_id IS DISTINCT FROM excluded.worker_id)
RETURNING jobs.tenant, jobs.job_id, jobs.attempts, CAST(jobs.params ->> 'seed' AS bigint)"""
)


_CLASSIFY = text(
    f"""SELECT jobs.tenant, jobs.job_id, jobs.status, jobs.published_at, jobs.cancel_requested_at
FROM jobs JOIN {KEYS} ON {KEYS_MATCH}"""
)


def _queued_row(r: Admission) -> tuple:
    """An admission's values in _QUEUED_COLUMNS order."""
    return (
        r.job_id, r.tenant, r.priority, r.prompt, r.params, r.bulk_id, r.created_at, r.queued_at, r.worker_id,
        r.source[0], r.source[1], r.source[2], r.generation, r.model,
    )  # fmt: skip


def mark_running(conn: Connection, started: Sequence[tuple[str, str, datetime, int]]) -> None:
    """One statement for a flush's worth of starts (tenant, job_id, when, attempt): per-row statements
    cost the worker's GIL time and a round trip each. A start of an attempt the job has moved past
    (re-queued elsewhere) writes nothing (the attempt fence)."""
    if started:
        conn.execute(_MARK_RUNNING, arrays(_RUNNING_FIELDS, started))


_RUNNING_FIELDS = (
    ("tenant", "text[]"), ("job_id", "text[]"), ("at", "timestamptz[]"), ("attempt", "integer[]")
)  # fmt: skip
_MARK_RUNNING = text(
    f"""UPDATE jobs SET status = 'running', started_at = v.at, updated_at = v.at
FROM {unnest(_RUNNING_FIELDS)}
WHERE jobs.tenant = v.tenant AND jobs.job_id = v.job_id AND jobs.status = 'queued'
  AND jobs.attempts = v.attempt"""
)


def _live(tenant: str | BindParameter, job_id: str | BindParameter, attempt: int | BindParameter | None):
    """The job's row while it is not terminal and, for a known attempt, still that attempt's."""
    where = (jobs.c.job_id == job_id) & (jobs.c.tenant == tenant) & jobs.c.status.not_in(TERMINAL_STATUSES)
    return where if attempt is None else where & (jobs.c.attempts == attempt)


def finish(conn: Connection, row: Terminal, now: datetime) -> Row | None:
    """Write one terminal row; the written row, or None if it was terminal already (never overwritten)
    or a later attempt owns the job now (a worker that lost the job's partition concluded it late)."""
    stmt = _finish_statement(tuple(sorted(row.values)), row.attempt is not None)
    params = {f"v_{k}": v for k, v in row.values.items()}
    params.update(finish_tenant=row.tenant, finish_id=row.job_id, finish_attempt=row.attempt)
    params.update(finish_status=row.status, finish_now=now)
    return conn.execute(stmt, params).first()


@lru_cache(maxsize=32)
def _finish_statement(columns: tuple[str, ...], fenced: bool) -> Update:
    """One prepared statement per set of columns: building and cache-keying a fresh UPDATE for every
    job cost the persister ~0.75 ms of GIL time a job, time the engine thread waited for."""
    attempt = bindparam("finish_attempt") if fenced else None
    where = _live(bindparam("finish_tenant"), bindparam("finish_id"), attempt)
    values = {c: bindparam(f"v_{c}") for c in columns}
    values.update(status=bindparam("finish_status"), updated_at=bindparam("finish_now"))
    return jobs.update().where(where).values(values).returning(*jobs.c)


def finish_many(conn: Connection, rows: Sequence[Terminal], now: datetime) -> list[Row | None]:
    """`finish` for many rows, one statement per set of columns written (one for a flush of finished jobs):
    what each wrote, in order (None: terminal already, or a later attempt owns the job). Copies of one job
    go in later rounds, in order, as one by one they would."""
    written: list[Row | None] = [None] * len(rows)
    pending = list(range(len(rows)))
    while pending:
        seen: set[JobKey] = set()
        later: list[int] = []
        groups: dict[tuple[tuple[str, ...], bool], list[int]] = {}
        for i in pending:
            key = rows[i].key
            if key in seen:
                later.append(i)
                continue
            seen.add(key)
            groups.setdefault((tuple(sorted(rows[i].values)), rows[i].attempt is not None), []).append(i)
        for (columns, fenced), members in groups.items():
            stmt, fields = _finish_many_statement(columns, fenced)
            values = [_finish_row(rows[i], columns, fenced) for i in members]
            params = {**arrays(fields, values), "now": now}
            by_key = {(r.tenant, r.job_id): r for r in conn.execute(stmt, params)}
            for i in members:
                written[i] = by_key.get(rows[i].key)
        pending = later
    return written


def _finish_row(row: Terminal, columns: tuple[str, ...], fenced: bool) -> tuple:
    head = (row.tenant, row.job_id, row.status) + ((row.attempt,) if fenced else ())
    return head + tuple(row.values[c] for c in columns)


@lru_cache(maxsize=32)
def _finish_many_statement(columns: tuple[str, ...], fenced: bool):
    head = [("tenant", "text[]"), ("job_id", "text[]"), ("status", "text[]")]
    if fenced:
        head.append(("attempt", "integer[]"))
    fields = (*head, *((c, array_type(jobs.c[c])) for c in columns))
    sets = ", ".join(f"{c} = v.{c}" for c in ("status", *columns))
    fence = " AND jobs.attempts = v.attempt" if fenced else ""
    returned = ", ".join(f"jobs.{c}" for c in RESULT_COLUMNS)
    stmt = text(
        f"""UPDATE jobs SET {sets}, updated_at = :now
FROM {unnest(fields)}
WHERE jobs.tenant = v.tenant AND jobs.job_id = v.job_id AND jobs.status NOT IN ({_TERMINAL_SQL}){fence}
RETURNING {returned}, jsonb_build_object('metadata', jobs.params -> 'metadata') AS params"""
    ).columns(*(jobs.c[c] for c in RESULT_COLUMNS), jobs.c.params)  # positions follow the columns given
    return stmt, fields


# What a written terminal row comes back with: the columns its result message is built from
# (outbox.result_from_row), and of its params only the metadata. The prompt (up to the size limit) and
# the request's parameters never make the round trip, nor are they decoded, for every finished job.
RESULT_COLUMNS = (
    "job_id", "tenant", "status", "priority", "output_text", "choices", "finish_reason", "prompt_tokens",
    "completion_tokens", "cached_tokens", "attempts", "worker_id", "bulk_id", "error", "created_at",
    "started_at", "first_token_at", "finished_at", "queue_ms", "ttft_ms", "mean_itl_ms", "e2e_ms",
)  # fmt: skip


def superseded_by(conn: Connection, tenant: str, job_id: str, attempt: int | None) -> Coordinates | None:
    """The record of a later attempt than `attempt` that owns the job and has not ended yet, if any."""
    if attempt is None:
        return None
    query = select(jobs.c.attempts, jobs.c.source_topic, jobs.c.source_partition, jobs.c.source_offset)
    current = conn.execute(query.where(_live(tenant, job_id, None))).first()
    if current is None or current.attempts == attempt:
        return None
    return current.source_topic, current.source_partition, current.source_offset


def insert_terminal(
    conn: Connection, tenant: str, job_id: str, status: str, values: dict[str, Any]
) -> Row | None:
    """A terminal row for a job that never ran here (rejected): the first wins, an existing id stays."""
    stmt = (
        insert(jobs)
        .values(**values, job_id=job_id, tenant=tenant, status=status)
        .on_conflict_do_nothing(index_elements=[jobs.c.job_id, jobs.c.tenant])
        .returning(*jobs.c)
    )
    return conn.execute(stmt).first()


def reject_admitted(
    conn: Connection, tenant: str, job_id: str, source: Coordinates, values: dict[str, Any]
) -> Row | None:
    """End as `rejected` the live row that this very record (`source`) admitted before, when the record's
    verdict has changed since (its adapter was removed, and a redelivery of it is refused): that row is
    this job's, and nobody would end it otherwise. None when there is no such row. `values`: a rejected
    row's; the admitted row keeps what it says of the job's arrival (prompt, created_at, class)."""
    ending = {k: v for k, v in values.items() if k not in _ARRIVAL}
    topic, partition, offset = source
    stmt = (
        jobs.update()
        .where(_live(tenant, job_id, None), jobs.c.source_topic == topic)
        .where(jobs.c.source_partition == partition, jobs.c.source_offset == offset)
        .values(**ending, status="rejected")
        .returning(*jobs.c)
    )
    return conn.execute(stmt).first()


_ARRIVAL = frozenset(
    ("prompt", "created_at", "priority", "source_topic", "source_partition", "source_offset")
)


def request_cancel(
    conn: Connection, job_id: str, tenant: str, at: datetime, worker_id: str, claim: dict[str, Any]
) -> Row | None:
    """Record a tenant's cancel durably; the row if it was created `cancelled` (nobody had the job yet).

    A queued or running job of that tenant gets `cancel_requested_at`: its owner aborts it, and any later
    admission (a redelivery after a crash) ends it as cancelled instead of running it. A cancel for an id
    the tenant has no job under yet makes a row of that tenant's only: no other tenant's id is touched.
    """
    stmt = insert(jobs).values(
        job_id=job_id,
        tenant=tenant,
        priority="unknown",
        status="cancelled",
        finish_reason="abort",
        error="cancelled before it started",
        created_at=at,
        finished_at=at,
        updated_at=at,
        cancel_requested_at=at,
        worker_id=worker_id,
        **claim,
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[jobs.c.job_id, jobs.c.tenant],
        set_={"cancel_requested_at": stmt.excluded.cancel_requested_at},
        where=jobs.c.status.not_in(TERMINAL_STATUSES) & jobs.c.cancel_requested_at.is_(None),
    ).returning(*jobs.c)
    row = conn.execute(stmt).first()
    return row if row is not None and row.status == "cancelled" else None


def cancel_requested(conn: Connection, keys: Sequence[JobKey]) -> set[JobKey]:
    """Of these (in-flight) jobs, (tenant, job_id) of those with a recorded cancel."""
    if not keys:
        return set()
    return {JobKey(tenant, job_id) for tenant, job_id in conn.execute(_CANCEL_REQUESTED, key_arrays(keys))}


_CANCEL_REQUESTED = text(
    f"""SELECT jobs.tenant, jobs.job_id FROM jobs JOIN {KEYS} ON {KEYS_MATCH}
WHERE jobs.cancel_requested_at IS NOT NULL"""
)


def fail(
    conn: Connection,
    tenant: str,
    job_id: str,
    error: str,
    now: datetime,
    claim: dict[str, Any],
    attempt: int | None = None,
) -> Row | None:
    """Make a job `failed` with a reason, writing nothing else (used when its real row cannot be stored)."""
    return conn.execute(
        jobs.update()
        .where(_live(tenant, job_id, attempt))
        .values(
            status="failed",
            finish_reason="error",
            error=error[:2000],
            finished_at=now,
            updated_at=now,
            **claim,
        )
        .returning(*jobs.c)
    ).first()


def status_of(conn: Connection, job_id: str, tenant: str = "default") -> str | None:
    query = select(jobs.c.status).where(jobs.c.job_id == job_id, jobs.c.tenant == tenant)
    return conn.execute(query).scalar_one_or_none()
