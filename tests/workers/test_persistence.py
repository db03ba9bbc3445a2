"""Admission and the persister against the real PostgreSQL and Kafka: tenant-owned ids, durable cancels,
the outbox, and writes PostgreSQL refuses that must not hold back the rest."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import create_engine, select

from schemas.tables import jobs
from tests.workers.worker_factories import job_rows, make_deployment, now_ms, results_by_job, wait_until
from workers.admission import Admitter
from workers.intake import Accepted
from workers.kafka_io import KeyLookup, Producer, Record
from workers.outbox import LEASE_S, claim, result_from_row
from workers.persister import Persister
from workers.store import Terminal, finish, make_engine
from workers.writes import CancelRequested, Concluded, Rejected, Republish, Running

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def env(settings):
    dep = make_deployment(settings)
    db = make_engine(dep.database_url)
    producer = Producer(dep.kafka_connection, "inferq-test-persistence")
    yield dep, db, producer
    producer.close()
    db.dispose()


def _accepted(dep, job_id: str, tenant: str = "t-a", offset: int = 0, prompt: str = "hello") -> Accepted:
    from schemas.jobs import JobRequest

    record = Record(dep.topics.jobs("normal"), 0, offset, job_id.encode(), b"{}", now_ms())
    job = JobRequest(job_id=job_id, tenant=tenant, prompt=prompt)
    return Accepted(record, job_id, "normal", job, prompt, (1, 2, 3), 8)


def _admit(dep, db, worker_id: str, jobs: dict[str, int]) -> None:
    """Admit jobs (job_id -> source offset) as `worker_id` would: their rows are then queued."""
    admitter = Admitter(db, worker_id)
    admitter.add([_accepted(dep, job_id, offset=offset) for job_id, offset in jobs.items()])
    admitter.run(lambda a: False)


def _persister(dep, db, producer) -> Persister:
    def dead_letter(r: Rejected):
        return producer.send(
            dep.topics.dlq, r.record.key, r.record.value or b"", [("reason", r.reason.encode())]
        )

    published = KeyLookup(dep.kafka_connection, "inferq-test-lookup")
    p = Persister(db, producer, dep.topics, "w-test", dead_letter=dead_letter, published=published)
    p.start()
    return p


def _run(persister: Persister, items) -> set:
    persister.submit(list(items))
    persister.close()
    return set(persister.acked())


def test_admission_keeps_ids_per_tenant_and_honours_cancels(env):
    dep, db, producer = env
    admitter = Admitter(db, "w-test")
    base = f"adm-{uuid.uuid4().hex[:8]}"
    admitter.add([_accepted(dep, f"{base}-1"), _accepted(dep, f"{base}-2", offset=1)])
    decisions, rejected = admitter.run(lambda a: False)
    assert [d.outcome.kind for d in decisions] == ["start", "start"] and not rejected
    assert [d.outcome.attempt for d in decisions] == [1, 1]

    # the same id from another tenant is refused, never merged; from the owner it is a new attempt
    admitter.add([_accepted(dep, f"{base}-1", tenant="t-b", offset=2), _accepted(dep, f"{base}-2", offset=3)])
    decisions, _ = admitter.run(lambda a: False)
    assert [(d.outcome.kind, d.outcome.attempt) for d in decisions] == [("foreign", 0), ("start", 2)]
    assert job_rows(db, [f"{base}-1"])[f"{base}-1"]["tenant"] == "t-a"

    # a cancel recorded while queued makes the next admission settle it as cancelled
    persister = _persister(dep, db, producer)
    at = datetime.now(UTC)
    _run(persister, [CancelRequested(f"{base}-2", "t-b", at), CancelRequested(f"{base}-2", "t-a", at)])
    admitter.add([_accepted(dep, f"{base}-2", offset=4)])
    decisions, _ = admitter.run(lambda a: False)
    assert decisions[0].outcome.kind == "cancelled"

    # two copies of one id in a batch: the first is admitted, the second waits for its outcome
    admitter.add([_accepted(dep, f"{base}-3", offset=5), _accepted(dep, f"{base}-3", offset=6)])
    decisions, _ = admitter.run(lambda a: False)
    assert [d.accepted.record.offset for d in decisions] == [5] and len(admitter) == 1
    decisions, _ = admitter.run(lambda a: a.job_id == f"{base}-3")
    assert [(d.accepted.record.offset, d.outcome.kind) for d in decisions] == [(6, "held")]


def test_a_row_postgres_refuses_is_split_off_and_the_rest_is_stored(env):
    dep, db, producer = env
    since = now_ms()
    base = f"split-{uuid.uuid4().hex[:8]}"
    _admit(dep, db, "w-test", {f"{base}-good": 10, f"{base}-bad": 11})
    topic = dep.topics.jobs("normal")
    now = datetime.now(UTC)
    good = Terminal(
        f"{base}-good", "succeeded", {"output_text": "fine", "finish_reason": "stop", "finished_at": now}
    )
    bad = Terminal(
        f"{base}-bad",
        "succeeded",
        {"output_text": "nul \x00 out", "finish_reason": "stop", "finished_at": now},
    )
    items = [Concluded(good, ((topic, 0, 10),)), Concluded(bad, ((topic, 0, 11),))]
    acked = _run(_persister(dep, db, producer), items)
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
    _admit(dep, db, "w-test", {job_id: 20 + i for i, job_id in enumerate(ids)})
    at = [datetime.now(UTC) for _ in ids]
    done = Terminal(ids[1], "succeeded", {"output_text": "x", "finish_reason": "stop", "finished_at": at[1]})
    topic = dep.topics.jobs("normal")
    # two starts, the end of the second (it stays terminal), then two more starts
    items = [Running(ids[0], at[0], 1), Running(ids[1], at[1], 1), Concluded(done, ((topic, 0, 21),)),
             Running(ids[2], at[2], 1), Running(ids[3], at[3], 1), Running(ids[1], at[1], 1)]  # fmt: skip
    _run(_persister(dep, db, producer), items)
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
    _admit(dep, db, "w-a", {job_id: 60})
    _admit(dep, db, "w-b", {job_id: 60})  # the new owner's admission: attempt 2
    now = datetime.now(UTC)
    values = {"output_text": "stale", "finish_reason": "stop", "finished_at": now}
    topic = dep.topics.jobs("normal")
    stale = [
        Running(job_id, now, 1),
        Concluded(Terminal(job_id, "succeeded", values, attempt=1), ((topic, 0, 60),)),
    ]
    assert _run(_persister(dep, db, producer), stale) == set()
    row = job_rows(db, [job_id])[job_id]
    assert (row["status"], row["attempts"], row["output_text"]) == ("queued", 2, None)
    fresh = [
        Running(job_id, now, 2),
        Concluded(
            Terminal(job_id, "succeeded", {**values, "output_text": "fresh"}, attempt=2), ((topic, 0, 60),)
        ),
    ]
    assert _run(_persister(dep, db, producer), fresh) == {(topic, 0, 60)}
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
    _admit(dep, db, "w-a", {job_id: 70})
    _admit(dep, db, "w-b", {job_id: 71})
    now = datetime.now(UTC)
    values = {"output_text": "stale", "finish_reason": "stop", "finished_at": now}
    topic = dep.topics.jobs("normal")
    stale = [Concluded(Terminal(job_id, "succeeded", values, attempt=1), ((topic, 0, 70),))]
    assert _run(_persister(dep, db, producer), stale) == {(topic, 0, 70)}
    row = job_rows(db, [job_id])[job_id]
    assert (row["status"], row["attempts"], row["output_text"]) == ("queued", 2, None)


def test_outbox_republishes_only_what_never_went_out(env):
    dep, db, producer = env
    since = now_ms()
    base = f"outbox-{uuid.uuid4().hex[:8]}"
    admitter = Admitter(db, "w-test")
    admitter.add([_accepted(dep, f"{base}-1", offset=20)])
    admitter.run(lambda a: False)
    now = datetime.now(UTC)
    row = Terminal(
        f"{base}-1", "succeeded", {"output_text": "out", "finish_reason": "length", "finished_at": now}
    )
    with db.begin() as conn:  # a worker that died between the commit and the publish left this
        finish(conn, row, now)
    admitter.add([_accepted(dep, f"{base}-1", offset=21)])
    decisions, _ = admitter.run(lambda a: False)
    assert decisions[0].outcome.kind == "done" and not decisions[0].outcome.published
    topic = dep.topics.jobs("normal")
    _run(_persister(dep, db, producer), [Republish(f"{base}-1", ((topic, 0, 21),))])
    assert job_rows(db, [f"{base}-1"])[f"{base}-1"]["published_at"] is not None
    _run(_persister(dep, db, producer), [Republish(f"{base}-1", ((topic, 0, 22),))])  # published: nothing
    results = results_by_job(dep, since, 1)
    assert [(r.status, r.output_text, r.tenant) for r in results[f"{base}-1"]] == [
        ("succeeded", "out", "t-a")
    ]


def test_a_foreign_rejection_is_announced_to_its_own_tenant_only(env):
    dep, db, producer = env
    since = now_ms()
    job_id = f"foreign-{uuid.uuid4().hex[:8]}"
    record = Record(dep.topics.jobs("high"), 0, 30, job_id.encode(), b'{"prompt": "x"}', now_ms())
    item = Rejected(
        record, job_id, "t-b", "high", "job_id belongs to another tenant", "foreign_tenant", False
    )
    assert _run(_persister(dep, db, producer), [item]) == {(record.topic, 0, 30)}
    assert job_rows(db, [job_id]) == {}  # the row (if any) belongs to the owner
    results = results_by_job(dep, since, 1)
    assert [(r.status, r.tenant) for r in results[job_id]] == [("rejected", "t-b")]


def test_engine_settings_bound_every_call(env):
    dep, db, _ = env
    with db.connect() as conn:
        timeout = conn.exec_driver_sql("SHOW statement_timeout").scalar()
    assert timeout == "15s"
    assert create_engine(dep.database_url).url.password  # the local cluster requires a password


def test_a_live_publishers_result_is_not_published_by_another_worker(env):
    dep, db, producer = env
    since = now_ms()
    base = f"lease-{uuid.uuid4().hex[:8]}"
    _admit(dep, db, "w-other", {f"{base}-1": 40})
    now = datetime.now(UTC)
    values = {"output_text": "out", "finish_reason": "stop", "finished_at": now, **claim("w-other", now)}
    with db.begin() as conn:  # w-other wrote it and is still trying to publish (say, the broker is away)
        finish(conn, Terminal(f"{base}-1", "succeeded", values), now)
    topic = dep.topics.jobs("normal")
    persister = _persister(dep, db, producer)
    persister.submit([Republish(f"{base}-1", ((topic, 0, 41),))])
    time.sleep(2)
    assert persister.acked() == []  # waits for the live publisher, unacked
    assert job_rows(db, [f"{base}-1"])[f"{base}-1"]["published_at"] is None
    with db.begin() as conn:  # w-other died: its lease lapses
        conn.execute(jobs.update().where(jobs.c.job_id == f"{base}-1").values(publish_lease_until=now))
    wait_until(lambda: (topic, 0, 41) in persister.acked(), timeout_s=60)
    persister.close()
    row = job_rows(db, [f"{base}-1"])[f"{base}-1"]
    assert row["published_at"] is not None and row["publisher"] == "w-test"
    assert len(results_by_job(dep, since, 1)[f"{base}-1"]) == 1


def test_a_result_its_dead_publisher_got_out_is_not_published_again(env):
    """The worker died after the broker took its result and before it set `published_at`: the worker
    that takes the job over finds the result in the topic, marks the row, and sends nothing."""
    dep, db, producer = env
    since = now_ms()
    base = f"landed-{uuid.uuid4().hex[:8]}"
    _admit(dep, db, "w-dead", {f"{base}-1": 50, f"{base}-2": 51})
    now = datetime.now(UTC)
    values = {"output_text": "out", "finish_reason": "stop", "finished_at": now, **claim("w-dead", now)}
    with db.begin() as conn:
        for n in (1, 2):
            finish(conn, Terminal(f"{base}-{n}", "succeeded", values), now)
        conn.execute(jobs.update().where(jobs.c.job_id.like(f"{base}-%")).values(publish_lease_until=now))
    with db.connect() as conn:  # what w-dead sent for job 1 before it died
        result = result_from_row(conn.execute(select(jobs).where(jobs.c.job_id == f"{base}-1")).one())
    producer.send(dep.topics.results, result.job_id, result.model_dump_json().encode()).wait()
    # job 2's id under another tenant: that tenant's `rejected` result is not job 2's result
    foreign = Rejected(Record("x", 0, 0, None, b"{}", now_ms()), f"{base}-2", "t-b", "high", "foreign", "x")
    producer.send(dep.topics.results, f"{base}-2", foreign.result().model_dump_json().encode()).wait()
    topic = dep.topics.jobs("normal")
    items = [Republish(f"{base}-{n}", ((topic, 0, 51 + n),)) for n in (1, 2)]
    assert _run(_persister(dep, db, producer), items) == {(topic, 0, 52), (topic, 0, 53)}
    rows = job_rows(db, [f"{base}-1", f"{base}-2"])
    assert all(r["published_at"] is not None and r["publisher"] == "w-test" for r in rows.values())
    results = results_by_job(dep, since, 3, settle_s=2.0)
    assert [r.tenant for r in results[f"{base}-1"]] == ["t-a"]
    assert [(r.tenant, r.status) for r in results[f"{base}-2"]] == [("t-b", "rejected"), ("t-a", "succeeded")]


def test_a_lease_written_moments_ago_is_kept_without_asking_and_an_older_one_is_renewed(env):
    dep, db, producer = env
    base = f"keep-{uuid.uuid4().hex[:8]}"
    ids = [f"{base}-1", f"{base}-2"]
    _admit(dep, db, "w-test", {ids[0]: 60, ids[1]: 61})
    now = datetime.now(UTC)
    values = {"output_text": "out", "finish_reason": "stop", "finished_at": now, **claim("w-test", now)}
    with db.begin() as conn:
        for job_id in ids:
            finish(conn, Terminal(job_id, "succeeded", values), now)
        # job 2's lease lapsed at some point and another worker took the row over
        conn.execute(jobs.update().where(jobs.c.job_id == ids[1]).values(publisher="w-other"))
    persister = Persister(db, producer, dep.topics, "w-test", dead_letter=None, published=None)
    # moments after this worker wrote the leases, nobody can have taken a row over: no round trip
    assert persister._keep(ids, claimed=time.monotonic()) == set(ids)
    assert job_rows(db, ids)[ids[0]]["publish_lease_until"] == values["publish_lease_until"]
    # later the table decides: job 1's lease is extended, job 2 is no longer this worker's to publish
    assert persister._keep(ids, claimed=time.monotonic() - LEASE_S) == {ids[0]}
    assert job_rows(db, ids)[ids[0]]["publish_lease_until"] > values["publish_lease_until"]
