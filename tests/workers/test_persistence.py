"""Admission and the persister against the real PostgreSQL and Kafka: ids scoped by tenant, durable cancels,
attempts, and writes PostgreSQL refuses that must not hold back the rest."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import create_engine, text

from tests.workers.persistence_factories import (
    accepted,
    admit_jobs,
    run_items,
    start_persister,
)
from tests.workers.worker_factories import job_rows, now_ms, results_by_job, tenant_rows
from workers.db.jobs import Terminal
from workers.kafka_io import Record
from workers.serving.admission.admitter import Admitter
from workers.serving.intake.rejected import Rejected
from workers.serving.outbox.writes import CancelRequested, Concluded, Running

pytestmark = pytest.mark.services


def test_admission_keeps_ids_per_tenant_and_honours_cancels(env):
    dep, db, producer = env
    admitter = Admitter(db, "w-test")
    base = f"adm-{uuid.uuid4().hex[:8]}"
    admitter.add([accepted(dep, f"{base}-1"), accepted(dep, f"{base}-2", offset=1)])
    decisions, rejected = admitter.run(lambda a: False)
    assert [d.outcome.kind for d in decisions] == ["start", "start"] and not rejected
    assert [d.outcome.attempt for d in decisions] == [1, 1]

    # the same id from another tenant is that tenant's own job (a row of its own, its first attempt);
    # from the owner it is a new attempt
    admitter.add([accepted(dep, f"{base}-1", tenant="t-b", offset=2), accepted(dep, f"{base}-2", offset=3)])
    decisions, _ = admitter.run(lambda a: False)
    assert [(d.outcome.kind, d.outcome.attempt) for d in decisions] == [("start", 1), ("start", 2)]
    rows = tenant_rows(db, f"{base}-1")
    assert {t: (r["status"], r["attempts"]) for t, r in rows.items()} == {
        "t-a": ("queued", 1),
        "t-b": ("queued", 1),
    }

    # a cancel recorded while queued makes the next admission settle it as cancelled; another tenant's
    # cancel of the same id touches only that tenant's (new, cancelled) row
    persister = start_persister(dep, db, producer)
    at = datetime.now(UTC)
    run_items(persister, [CancelRequested(f"{base}-2", "t-b", at)])
    assert tenant_rows(db, f"{base}-2")["t-a"]["cancel_requested_at"] is None
    persister = start_persister(dep, db, producer)
    run_items(persister, [CancelRequested(f"{base}-2", "t-a", at)])
    admitter.add([accepted(dep, f"{base}-2", offset=4)])
    decisions, _ = admitter.run(lambda a: False)
    assert decisions[0].outcome.kind == "cancelled"

    # two copies of one id in a batch: the first is admitted, the second waits for its outcome
    admitter.add([accepted(dep, f"{base}-3", offset=5), accepted(dep, f"{base}-3", offset=6)])
    decisions, _ = admitter.run(lambda a: False)
    assert [d.accepted.record.offset for d in decisions] == [5] and len(admitter) == 1
    decisions, _ = admitter.run(lambda a: a.job_id == f"{base}-3")
    assert [(d.accepted.record.offset, d.outcome.kind) for d in decisions] == [(6, "held")]


def test_a_worker_whose_own_newer_attempt_it_no_longer_runs_re_admits_an_older_copy(env):
    """The row's newer-generation attempt is this worker's own, and the worker does not run it (it was
    aborted here without a row: the admitter is asked only about jobs the worker does not hold): an older
    copy re-admits the job instead of waiting, as `superseded`, for a run nobody does."""
    dep, db, _ = env
    job = f"own-{uuid.uuid4().hex[:8]}"
    worker = Admitter(db, "w-same")
    worker.add([accepted(dep, job, offset=5, generation=8)])
    assert [d.outcome.kind for d in worker.run(lambda a: False)[0]] == ["start"]
    worker.add([accepted(dep, job, offset=4, generation=7)])  # an older copy (another record of the job)
    assert [(d.outcome.kind, d.outcome.attempt) for d in worker.run(lambda a: False)[0]] == [("start", 2)]
    row = job_rows(db, [job])[job]
    got = (row["worker_id"], row["attempts"], row["admitted_generation"], row["source_offset"])
    assert got == ("w-same", 2, 7, 4)


def test_a_late_admission_from_an_older_group_generation_leaves_the_new_owner_its_run(env):
    """A worker whose admission ran late, after the record's partition moved on, must not re-queue the row
    under an attempt nobody runs (the new owner's result would be fenced out, its partition stalled)."""
    dep, db, _ = env
    job = f"gen-{uuid.uuid4().hex[:8]}"
    new_owner, late = Admitter(db, "w-new"), Admitter(db, "w-late")
    new_owner.add([accepted(dep, job, generation=8)])
    assert [d.outcome.kind for d in new_owner.run(lambda a: False)[0]] == ["start"]
    late.add([accepted(dep, job, generation=7)])
    assert [d.outcome.kind for d in late.run(lambda a: False)[0]] == ["superseded"]
    row = job_rows(db, [job])[job]
    assert (row["worker_id"], row["attempts"], row["admitted_generation"]) == ("w-new", 1, 8)
    # a copy fetched in the same or a later generation is a redelivery as before: a new attempt
    late.add([accepted(dep, job, offset=1, generation=8)])
    assert [(d.outcome.kind, d.outcome.attempt) for d in late.run(lambda a: False)[0]] == [("start", 2)]
    # a generation long untouched is not trusted (a group made again counts from 0)
    with db.begin() as conn:
        conn.execute(
            text("UPDATE jobs SET updated_at = now() - interval '11 minutes' WHERE job_id = :j"), {"j": job}
        )
    new_owner.add([accepted(dep, job, offset=2, generation=1)])
    assert [(d.outcome.kind, d.outcome.attempt) for d in new_owner.run(lambda a: False)[0]] == [("start", 3)]


def test_a_row_postgres_refuses_is_split_off_and_the_rest_is_stored(env):
    dep, db, producer = env
    since = now_ms()
    base = f"split-{uuid.uuid4().hex[:8]}"
    admit_jobs(dep, db, "w-test", {f"{base}-good": 10, f"{base}-bad": 11})
    topic = dep.topics.jobs("normal")
    now = datetime.now(UTC)
    good = Terminal(
        f"{base}-good",
        "succeeded",
        {"output_text": "fine", "finish_reason": "stop", "finished_at": now},
        tenant="t-a",
    )
    bad = Terminal(
        f"{base}-bad",
        "succeeded",
        {"output_text": "nul \x00 out", "finish_reason": "stop", "finished_at": now},
        tenant="t-a",
    )
    items = [Concluded(good, ((topic, 0, 10),)), Concluded(bad, ((topic, 0, 11),))]
    acked = run_items(start_persister(dep, db, producer), items)
    assert acked == {(topic, 0, 10), (topic, 0, 11)}
    rows = job_rows(db, [f"{base}-good", f"{base}-bad"])
    assert rows[f"{base}-good"]["status"] == "succeeded" and rows[f"{base}-good"]["output_text"] == "fine"
    assert rows[f"{base}-bad"]["status"] == "failed" and "could not be stored" in rows[f"{base}-bad"]["error"]
    assert all(row["published_at"] is not None for row in rows.values())
    results = results_by_job(dep, since, 2)
    assert [r.status for r in results[f"{base}-good"]] == ["succeeded"]
    assert [r.status for r in results[f"{base}-bad"]] == ["failed"]


def test_running_marks_go_in_order_with_the_other_writes(env):
    dep, db, producer = env
    base = f"run-{uuid.uuid4().hex[:8]}"
    ids = [f"{base}-{i}" for i in range(4)]
    admit_jobs(dep, db, "w-test", {job_id: 20 + i for i, job_id in enumerate(ids)})
    at = [datetime.now(UTC) for _ in ids]
    done = Terminal(
        ids[1], "succeeded", {"output_text": "x", "finish_reason": "stop", "finished_at": at[1]}, tenant="t-a"
    )
    topic = dep.topics.jobs("normal")
    # two starts, the end of the second (it stays terminal), then two more starts
    run = [Running(job_id, when, 1, tenant="t-a") for job_id, when in zip(ids, at, strict=True)]
    items = [run[0], run[1], Concluded(done, ((topic, 0, 21),)), run[2], run[3], run[1]]
    run_items(start_persister(dep, db, producer), items)
    rows = job_rows(db, ids)
    assert [rows[job_id]["status"] for job_id in ids] == ["running", "succeeded", "running", "running"]
    assert [rows[job_id]["started_at"] for job_id in ids] == at


def test_an_attempt_a_later_one_replaced_writes_nothing_and_leaves_the_record_to_it(env):
    """Worker A lost the job's partition just as it concluded attempt 1; the new owner re-queued the job
    (attempt 2) before A's write landed. A's row, start and result are dropped, its record not acked: the
    row and its result are attempt 2's alone, so the result and the token stream agree on the attempt."""
    dep, db, producer = env
    since = now_ms()
    job_id = f"fence-{uuid.uuid4().hex[:8]}"
    admit_jobs(dep, db, "w-a", {job_id: 60})
    admit_jobs(dep, db, "w-b", {job_id: 60})  # the new owner's admission: attempt 2
    now = datetime.now(UTC)
    values = {"output_text": "stale", "finish_reason": "stop", "finished_at": now}
    topic = dep.topics.jobs("normal")
    stale = [
        Running(job_id, now, 1, tenant="t-a"),
        Concluded(Terminal(job_id, "succeeded", values, attempt=1, tenant="t-a"), ((topic, 0, 60),)),
    ]
    assert run_items(start_persister(dep, db, producer), stale) == set()
    row = job_rows(db, [job_id])[job_id]
    assert (row["status"], row["attempts"], row["output_text"]) == ("queued", 2, None)
    fresh = [
        Running(job_id, now, 2, tenant="t-a"),
        Concluded(
            Terminal(job_id, "succeeded", {**values, "output_text": "fresh"}, attempt=2, tenant="t-a"),
            ((topic, 0, 60),),
        ),
    ]
    assert run_items(start_persister(dep, db, producer), fresh) == {(topic, 0, 60)}
    row = job_rows(db, [job_id])[job_id]
    assert (row["status"], row["attempts"], row["output_text"]) == ("succeeded", 2, "fresh")
    [result] = results_by_job(dep, since, 1, settle_s=2.0)[job_id]
    assert (result.attempt, result.output_text) == (2, "fresh")


def test_an_attempt_replaced_from_another_record_acks_its_own(env):
    """A copy of the job on another record re-queued it (attempt 2) while attempt 1 ran: attempt 1 writes
    nothing, but its record is acked, since attempt 2's record stays unacked until the job ends (a
    record left pending forever would stop the partition's commits)."""
    dep, db, producer = env
    job_id = f"fence2-{uuid.uuid4().hex[:8]}"
    admit_jobs(dep, db, "w-a", {job_id: 70})
    admit_jobs(dep, db, "w-b", {job_id: 71})
    now = datetime.now(UTC)
    values = {"output_text": "stale", "finish_reason": "stop", "finished_at": now}
    topic = dep.topics.jobs("normal")
    stale = [Concluded(Terminal(job_id, "succeeded", values, attempt=1, tenant="t-a"), ((topic, 0, 70),))]
    assert run_items(start_persister(dep, db, producer), stale) == {(topic, 0, 70)}
    row = job_rows(db, [job_id])[job_id]
    assert (row["status"], row["attempts"], row["output_text"]) == ("queued", 2, None)


def test_a_rejection_is_its_own_tenants_and_leaves_another_tenants_job_of_that_id_alone(env):
    dep, db, producer = env
    since = now_ms()
    job_id = f"scoped-{uuid.uuid4().hex[:8]}"
    admit_jobs(dep, db, "w-test", {job_id: 29})  # tenant t-a's job, queued
    record = Record(dep.topics.jobs("high"), 0, 30, job_id.encode(), b'{"prompt": "x"}', now_ms())
    item = Rejected(record, job_id, "t-b", "high", "not a valid job", "invalid")
    assert run_items(start_persister(dep, db, producer), [item]) == {(record.topic, 0, 30)}
    rows = tenant_rows(db, job_id)
    assert {t: r["status"] for t, r in rows.items()} == {"t-a": "queued", "t-b": "rejected"}
    results = results_by_job(dep, since, 1)
    assert [(r.status, r.tenant) for r in results[job_id]] == [("rejected", "t-b")]


def test_engine_settings_bound_every_call(env):
    dep, db, _ = env
    with db.connect() as conn:
        timeout = conn.exec_driver_sql("SHOW statement_timeout").scalar()
    assert timeout == "15s"
    assert create_engine(dep.database_url).url.password  # the local cluster requires a password
