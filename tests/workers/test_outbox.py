"""The result outbox against the real PostgreSQL and Kafka: a result goes out once, by the worker that
holds its publish lease, and is looked for before a dead publisher's result is sent again."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import select

from schemas.tables import jobs
from tests.workers.persistence_factories import (
    accepted,
    admit_jobs,
    run_items,
    start_persister,
)
from tests.workers.worker_factories import job_rows, now_ms, results_by_job, wait_until
from workers.db.jobs import Terminal, finish
from workers.db.outbox import LEASE_S, claim, result_from_row
from workers.kafka_io import Record
from workers.serving.admission import Admitter
from workers.serving.persister import Persister
from workers.serving.writes import Rejected, Republish

pytestmark = pytest.mark.services


def test_outbox_republishes_only_what_never_went_out(env):
    dep, db, producer = env
    since = now_ms()
    base = f"outbox-{uuid.uuid4().hex[:8]}"
    admitter = Admitter(db, "w-test")
    admitter.add([accepted(dep, f"{base}-1", offset=20)])
    admitter.run(lambda a: False)
    now = datetime.now(UTC)
    row = Terminal(
        f"{base}-1", "succeeded", {"output_text": "out", "finish_reason": "length", "finished_at": now}
    )
    with db.begin() as conn:  # a worker that died between the commit and the publish left this
        finish(conn, row, now)
    admitter.add([accepted(dep, f"{base}-1", offset=21)])
    decisions, _ = admitter.run(lambda a: False)
    assert decisions[0].outcome.kind == "done" and not decisions[0].outcome.published
    topic = dep.topics.jobs("normal")
    run_items(start_persister(dep, db, producer), [Republish(f"{base}-1", ((topic, 0, 21),))])
    assert job_rows(db, [f"{base}-1"])[f"{base}-1"]["published_at"] is not None
    run_items(
        start_persister(dep, db, producer), [Republish(f"{base}-1", ((topic, 0, 22),))]
    )  # published: nothing
    results = results_by_job(dep, since, 1)
    assert [(r.status, r.output_text, r.tenant) for r in results[f"{base}-1"]] == [
        ("succeeded", "out", "t-a")
    ]


def test_a_live_publishers_result_is_not_published_by_another_worker(env):
    dep, db, producer = env
    since = now_ms()
    base = f"lease-{uuid.uuid4().hex[:8]}"
    admit_jobs(dep, db, "w-other", {f"{base}-1": 40})
    now = datetime.now(UTC)
    values = {"output_text": "out", "finish_reason": "stop", "finished_at": now, **claim("w-other", now)}
    with db.begin() as conn:  # w-other wrote it and is still trying to publish (say, the broker is away)
        finish(conn, Terminal(f"{base}-1", "succeeded", values), now)
    topic = dep.topics.jobs("normal")
    persister = start_persister(dep, db, producer)
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
    admit_jobs(dep, db, "w-dead", {f"{base}-1": 50, f"{base}-2": 51})
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
    assert run_items(start_persister(dep, db, producer), items) == {(topic, 0, 52), (topic, 0, 53)}
    rows = job_rows(db, [f"{base}-1", f"{base}-2"])
    assert all(r["published_at"] is not None and r["publisher"] == "w-test" for r in rows.values())
    results = results_by_job(dep, since, 3, settle_s=2.0)
    assert [r.tenant for r in results[f"{base}-1"]] == ["t-a"]
    assert [(r.tenant, r.status) for r in results[f"{base}-2"]] == [("t-b", "rejected"), ("t-a", "succeeded")]


def test_a_lease_written_moments_ago_is_kept_without_asking_and_an_older_one_is_renewed(env):
    dep, db, producer = env
    base = f"keep-{uuid.uuid4().hex[:8]}"
    ids = [f"{base}-1", f"{base}-2"]
    admit_jobs(dep, db, "w-test", {ids[0]: 60, ids[1]: 61})
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
