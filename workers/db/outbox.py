"""The result outbox: a terminal row is the durable record of its result until `published_at` is set.

The worker that wrote a terminal row holds a lease on publishing its result (`publisher`,
`publish_lease_until`) and renews it before every try (one written moments ago needs no renewing), so
however long the broker is away, nobody else publishes that result while the writer lives; a worker
that re-reads the job takes it over only once the lease has lapsed (the writer died). A result that may
be out already (a take-over: the writer may have died after the broker took it, before `published_at`
was committed; or a send that failed after it left) is looked for in the results topic first, from its
row's `finished_at`, and sent only if it is not there. Results are always built from the stored row, so
in the one window left (a lookup that misses a send the broker writes only afterwards) a second copy is
byte-for-byte the same message.

A result too large for the results topic is noted in its row (`error`, starting with COMPACT_NOTE) and
from then on built in its compact form (see `result_from_row`): the row stays what it was, output and all,
and whoever publishes it later (a sweeper, a redelivery) builds the same compact message.
Rows whose lease lapsed are claimed by every worker's sweeper (`claim_lapsed`), a bounded batch at a time,
so their results go out without waiting for a redelivery of their records.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Row, func, literal, select, text, tuple_

from schemas.job_key import JobKey
from schemas.jobs import Choice, JobResult, Timings, Usage
from schemas.tables import TERMINAL_STATUSES, jobs
from workers.db.sets import KEYS, KEYS_MATCH, key_arrays

# Engine finish reasons that are not in the contract's FinishReasonName map to these.
_FINISH_REASONS = {"stop", "length", "tool_calls", "abort", "expired", "rejected", "error"}

# Starts the `error` of a row whose full result the results topic refused for its size.
COMPACT_NOTE = "result too large for the results topic"
COMPACT_ERROR_CHARS = 1000  # of the row's error, in a compact result: it must stay small


def result_from_row(row: Row) -> JobResult:
    """The row's result message. For a row noted as too large to publish, its compact form: what can grow
    without bound (output_text, choices, the request's metadata) is left out, the row keeps it; and a
    result never says `succeeded` without its output, so a succeeded job's compact result is `failed`
    (finish reason `error`) with the note saying why and where the output is."""
    r = row._mapping if isinstance(row, Row) else vars(row)  # by key: a Row's attributes cost 0.35 µs each
    usage = None
    if r["prompt_tokens"] is not None or r["completion_tokens"] is not None:
        usage = Usage(
            prompt_tokens=r["prompt_tokens"] or 0,
            completion_tokens=r["completion_tokens"] or 0,
            cached_tokens=r.get("cached_tokens"),
        )
    finish = r["finish_reason"] if r["finish_reason"] in _FINISH_REASONS else None
    params = r["params"] or {}
    fields = dict(
        job_id=r["job_id"],
        status=r["status"],
        tenant=r["tenant"],
        priority=r["priority"],
        output_text=r["output_text"],
        finish_reason=finish,
        usage=usage,
        timings=Timings(**{name: r[name] for name in Timings.model_fields}),  # same names
        attempt=r["attempts"],
        worker_id=r["worker_id"],
        bulk_id=r["bulk_id"],
        error=r["error"],
        metadata=params.get("metadata") or {},
        choices=[Choice(**c) for c in choices_of(r["output_text"], finish, r["choices"])],
    )
    if is_compact(r["error"]):
        fields.update(output_text=None, metadata={}, choices=[], error=r["error"][:COMPACT_ERROR_CHARS])
        if r["status"] == "succeeded":
            fields.update(status="failed", finish_reason="error")
    return JobResult(**fields)


def choices_of(
    output_text: str | None, finish_reason: str | None, stored: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """A job's choices from its row: the stored ones (n > 1 or logprobs), else its one output as choice 0,
    else none (it never ran)."""
    if stored:
        return stored
    if output_text is None:
        return []
    return [{"index": 0, "text": output_text, "finish_reason": finish_reason, "logprobs": None}]


def is_compact(error: str | None) -> bool:
    """Whether a row's (or result's) error marks its result as the compact form."""
    return error is not None and error.startswith(COMPACT_NOTE)


def note_too_large(conn: Connection, key: JobKey, worker_id: str, note: str, now: datetime) -> Row | None:
    """Mark a row whose result this worker publishes as too large (its result is the compact form from
    now on); `note` starts with COMPACT_NOTE and goes before the row's own error. None when the row is no
    longer this worker's to publish (taken over, or published)."""
    prior = func.coalesce(literal("; ") + jobs.c.error, literal(""))
    stmt = (
        jobs.update()
        .where(_is(key), jobs.c.publisher == worker_id, jobs.c.published_at.is_(None))
        .values(error=literal(note) + prior, updated_at=now)
        .returning(*jobs.c)
    )
    return conn.execute(stmt).first()


LEASE_S = 30.0  # longer than one publish round (5 s) plus the backoff between rounds (at most 5 s)


def claim(worker_id: str, now: datetime) -> dict[str, object]:
    """Column values that make `worker_id` the publisher of a row it is writing as terminal."""
    return {"publisher": worker_id, "publish_lease_until": now + timedelta(seconds=LEASE_S)}


def renew(conn: Connection, keys: Sequence[JobKey], worker_id: str, now: datetime) -> set[JobKey]:
    """Extend this worker's leases; the jobs it still publishes (not taken over, not published)."""
    if not keys:
        return set()
    params = {**key_arrays(keys), "worker": worker_id, "until": now + timedelta(seconds=LEASE_S)}
    return {JobKey(tenant, job_id) for tenant, job_id in conn.execute(_RENEW, params)}


def _is(key: JobKey):
    return (jobs.c.tenant == key[0]) & (jobs.c.job_id == key[1])


_RENEW = text(
    f"""UPDATE jobs SET publish_lease_until = :until FROM {KEYS}
WHERE {KEYS_MATCH} AND jobs.publisher = :worker AND jobs.published_at IS NULL
RETURNING jobs.tenant, jobs.job_id"""
)
_MARK_PUBLISHED = text(
    f"""UPDATE jobs SET published_at = :at, publish_lease_until = NULL FROM {KEYS}
WHERE {KEYS_MATCH} AND jobs.publisher = :worker"""
)


def _unpublished():
    return (jobs.c.status.in_(TERMINAL_STATUSES), jobs.c.published_at.is_(None))


def _lapsed(now: datetime):
    """No live publisher: its writer never claimed it, or died (or stalled) past its lease."""
    return jobs.c.publish_lease_until.is_(None) | (jobs.c.publish_lease_until < now)


def take_over(conn: Connection, key: JobKey, worker_id: str, now: datetime) -> tuple[str, Row | None]:
    """For a redelivered terminal job: ("published", None), ("taken", row) when this worker may publish
    its result now (its own lease, or a lapsed one), or ("held", None) while another publisher's holds."""
    stmt = (
        jobs.update()
        .where(_is(key), *_unpublished(), (jobs.c.publisher == worker_id) | _lapsed(now))
        .values(**claim(worker_id, now))
        .returning(*jobs.c)
    )
    row = conn.execute(stmt).first()
    if row is not None:
        return "taken", row
    published = conn.execute(select(jobs.c.published_at).where(_is(key))).first()
    return ("held", None) if published is not None and published.published_at is None else ("published", None)


def claim_lapsed(
    conn: Connection,
    worker_id: str,
    now: datetime,
    source_topics: Sequence[str],
    limit: int,
    source_prefix: str | None = None,
) -> list[Row]:
    """Claim (as `take_over` does) up to `limit` unpublished terminal rows whose lease lapsed, oldest
    first, among the jobs that came from `source_topics`, or from topics named `source_prefix`... (one
    deployment's: a database may serve several, and a result must go to its own deployment's topic). Rows
    another sweeper is claiming at the same time are skipped, not waited for."""
    ours = jobs.c.source_topic.in_(list(source_topics))
    if source_prefix:  # per-tenant topics: whichever tenants exist
        ours = ours | jobs.c.source_topic.startswith(source_prefix, autoescape=True)
    pick = (
        select(jobs.c.tenant, jobs.c.job_id)
        .where(*_unpublished(), _lapsed(now), ours)
        .order_by(jobs.c.finished_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    stmt = (
        jobs.update()
        .where(tuple_(jobs.c.tenant, jobs.c.job_id).in_(pick), *_unpublished(), _lapsed(now))
        .values(**claim(worker_id, now))
        .returning(*jobs.c)
    )
    return list(conn.execute(stmt))


def mark_published(conn: Connection, keys: Sequence[JobKey], worker_id: str, now: datetime) -> None:
    if keys:
        conn.execute(_MARK_PUBLISHED, {**key_arrays(keys), "worker": worker_id, "at": now})


def count_unpublished(conn: Connection) -> int:
    query = select(func.count()).where(*_unpublished())
    return int(conn.execute(query).scalar_one())
