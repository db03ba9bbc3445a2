"""The set-based job writes (one statement for many jobs) keep the per-row rules, on the real PostgreSQL:
the attempt fence refuses a stale attempt's start or terminal row, a terminal row is never overwritten,
copies of one job in a batch apply in order, and one admission statement classifies every job of a batch
(new, re-queued, terminal, cancelled, owned by a worker of a later generation). `env` is in conftest.py."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from tests.workers.worker_factories import job_rows
from workers.db.jobs import Admission, Terminal, admit, finish_many, mark_running, request_cancel
from workers.db.outbox import claim, result_from_row
from workers.serving.outbox.writes import Concluded, Running, WriteContext, apply_all

pytestmark = pytest.mark.services

TENANT = "t-set"


def admission(dep, job_id: str, worker: str = "w-set", generation: int = 0, offset: int = 0) -> Admission:
    now = datetime.now(UTC)
    return Admission(
        job_id=job_id,
        tenant=TENANT,
        priority="normal",
        prompt="p",
        params={"max_tokens": 4, "metadata": {"k": "v"}},
        bulk_id=None,
        created_at=now,
        queued_at=now,
        worker_id=worker,
        source=(dep.topics.jobs("normal"), 0, offset),
        generation=generation,
    )


def ended(job_id: str, attempt: int | None, text: str, status: str = "succeeded") -> Terminal:
    now = datetime.now(UTC)
    values = {"output_text": text, "finish_reason": "stop", "finished_at": now, "completion_tokens": 1,
              "choices": [{"index": 0, "text": text}], "ttft_ms": 1.5, **claim("w-set", now)}  # fmt: skip
    return Terminal(job_id, status, values, attempt=attempt, tenant=TENANT)


def ids(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"set-{tag}-{i}" for i in range(n)]


def test_one_admission_statement_classifies_a_mixed_batch(env):
    dep, db, _ = env
    fresh, requeued, done, cancelled, newer = ids(5)
    with db.begin() as conn:  # the state each job is in before the batch
        first = admit(conn, [admission(dep, j) for j in (requeued, done, cancelled)])
        assert {k[1]: v.attempt for k, v in first.items()} == {requeued: 1, done: 1, cancelled: 1}
        assert finish_many(conn, [ended(done, 1, "out")], datetime.now(UTC))[0] is not None
        now = datetime.now(UTC)
        request_cancel(conn, cancelled, TENANT, now, "w-set", claim("w-set", now))
        admit(conn, [admission(dep, newer, worker="w-other", generation=9)])
    batch = [admission(dep, j, generation=5, offset=7) for j in (fresh, requeued, done, cancelled, newer)]
    with db.begin() as conn:
        outcome = {job_id: v for (_, job_id), v in admit(conn, batch).items()}
    assert {j: (o.kind, o.attempt) for j, o in outcome.items()} == {
        fresh: ("start", 1),
        requeued: ("start", 2),
        done: ("done", 0),
        cancelled: ("cancelled", 0),
        newer: ("superseded", 0),
    }
    rows = job_rows(db, [fresh, requeued, newer])
    assert rows[requeued]["source_offset"] == 7 and rows[requeued]["admitted_generation"] == 5
    assert rows[fresh]["params"] == {"max_tokens": 4, "metadata": {"k": "v"}}  # JSON, not a string
    assert rows[newer]["worker_id"] == "w-other" and rows[newer]["attempts"] == 1  # untouched


def test_a_stale_attempt_is_refused_in_the_set_forms(env):
    dep, db, _ = env
    current, stale = ids(2)
    with db.begin() as conn:
        admit(conn, [admission(dep, j) for j in (current, stale)])
        admit(conn, [admission(dep, stale)])  # re-queued: attempt 2 owns it now
        later = datetime.now(UTC) + timedelta(seconds=1)
        mark_running(conn, [(TENANT, current, later, 1), (TENANT, stale, later, 1)])
    rows = job_rows(db, [current, stale])
    assert (rows[current]["status"], rows[current]["started_at"]) == ("running", later)
    assert (rows[stale]["status"], rows[stale]["attempts"], rows[stale]["started_at"]) == ("queued", 2, None)
    with db.begin() as conn:
        written = finish_many(conn, [ended(current, 1, "a"), ended(stale, 1, "b")], datetime.now(UTC))
    assert written[0] is not None and written[0].output_text == "a" and written[0].choices[0]["text"] == "a"
    assert written[1] is None  # attempt 1 no longer owns the job
    rows = job_rows(db, [current, stale])
    assert rows[current]["status"] == "succeeded" and rows[current]["ttft_ms"] == 1.5
    assert (rows[stale]["status"], rows[stale]["output_text"]) == ("queued", None)


def test_a_terminal_row_is_never_overwritten_and_copies_apply_in_order(env):
    dep, db, _ = env
    (job,) = ids(1)
    with db.begin() as conn:
        admit(conn, [admission(dep, job)])
        written = finish_many(
            conn, [ended(job, 1, "first"), ended(job, 1, "second", status="failed")], datetime.now(UTC)
        )
    assert written[0].output_text == "first" and written[1] is None
    with db.begin() as conn:
        assert finish_many(conn, [ended(job, None, "third")], datetime.now(UTC)) == [None]
    row = job_rows(db, [job])[job]
    assert (row["status"], row["output_text"]) == ("succeeded", "first")


def test_apply_all_writes_starts_and_ends_of_a_flush_and_reports_the_superseded(env):
    dep, db, _ = env
    one, two, moved = ids(3)
    with db.begin() as conn:
        admit(conn, [admission(dep, j) for j in (one, two, moved)])
        admit(conn, [admission(dep, moved, offset=9)])  # attempt 2, from offset 9
    now = datetime.now(UTC)
    src = (dep.topics.jobs("normal"), 0, 0)
    items = [
        Running(one, now, 1, tenant=TENANT),
        Running(two, now, 1, tenant=TENANT),
        Concluded(ended(one, 1, "x"), (src,)),
        Running(moved, now, 1, tenant=TENANT),
        Concluded(ended(moved, 1, "late"), (src,)),
    ]
    with db.begin() as conn:
        stored = apply_all(conn, items, WriteContext("w-set", now))
    assert [r.job_id for r in stored.outbox] == [one]
    assert [(item.row.job_id, later) for item, later in stored.superseded] == [
        (moved, (dep.topics.jobs("normal"), 0, 9))
    ]
    rows = job_rows(db, [one, two, moved])
    assert [rows[j]["status"] for j in (one, two, moved)] == ["succeeded", "running", "queued"]
    assert rows[one]["started_at"] == now and rows[one]["publisher"] == "w-set"


def test_a_start_and_end_in_one_flush_are_one_row_write_with_the_start_kept(env):
    """A job that starts and ends within one flush (a short job under load) is written once, as its
    terminal row with its started_at: the `running` version of the row is never written. A start whose
    end is not in the flush is still written, and the fence still refuses a stale attempt's end."""
    from sqlalchemy import event

    dep, db, _ = env
    short, long_, stale = ids(3)
    with db.begin() as conn:
        admit(conn, [admission(dep, j) for j in (short, long_, stale)])
        admit(conn, [admission(dep, stale, offset=5)])  # attempt 2 owns it now
    started = datetime.now(UTC) - timedelta(seconds=1)
    src = (dep.topics.jobs("normal"), 0, 0)
    items = [
        Running(short, started, 1, tenant=TENANT),
        Running(long_, started, 1, tenant=TENANT),
        Running(stale, started, 1, tenant=TENANT),
        Concluded(ended(short, 1, "s"), (src,)),
        Concluded(ended(stale, 1, "late"), (src,)),
    ]
    sent: list[tuple[str, dict]] = []
    with db.begin() as conn:
        event.listen(conn, "before_cursor_execute", lambda *a: sent.append((a[2], a[3])))
        stored = apply_all(conn, items, WriteContext("w-set", datetime.now(UTC)))
    # the written row comes back with what its result needs: not the prompt, of the params the metadata
    (row,) = stored.outbox
    assert "prompt" not in row._fields and row.params == {"metadata": {"k": "v"}}
    result = result_from_row(row)
    assert (result.job_id, result.metadata, result.output_text, result.attempt) == (short, {"k": "v"}, "s", 1)
    assert result.timings.started_at == started
    marked = [params["v_job_id"] for statement, params in sent if "status = 'running'" in statement]
    assert marked == [f'{{"{long_}"}}']  # the one start whose end was not in the flush (an array literal)
    rows = job_rows(db, [short, long_, stale])
    assert rows[short]["status"] == "succeeded" and rows[short]["started_at"] == started
    assert rows[long_]["status"] == "running" and rows[long_]["started_at"] == started
    assert rows[stale]["status"] == "queued" and rows[stale]["started_at"] is None
