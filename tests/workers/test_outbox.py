"""The result outbox against the real PostgreSQL and Kafka: a result goes out once, by the worker that
holds its publish lease, and is looked for before a dead publisher's result is sent again."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from kafka.admin import ConfigResource, KafkaAdminClient
from sqlalchemy import select

import workers.kafka_io.producer as producers
import workers.serving.outbox.persister as persisters
from schemas.tables import jobs
from tests.workers.persistence_factories import (
    accepted,
    admit_jobs,
    run_items,
    start_persister,
)
from tests.workers.worker_factories import job_rows, make_deployment, now_ms, results_by_job, wait_until
from workers.db.connect import make_engine
from workers.db.jobs import Terminal, finish
from workers.db.outbox import COMPACT_NOTE, LEASE_S, claim, result_from_row
from workers.kafka_io import KeyLookup, Producer, Record
from workers.kafka_io.admin import max_message_bytes
from workers.serving.admission.admitter import Admitter
from workers.serving.intake.rejected import Rejected
from workers.serving.outbox.persister import Persister
from workers.serving.outbox.writes import Concluded, Republish

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
        f"{base}-1",
        "succeeded",
        {"output_text": "out", "finish_reason": "length", "finished_at": now},
        tenant="t-a",
    )
    with db.begin() as conn:  # a worker that died between the commit and the publish left this
        finish(conn, row, now)
    admitter.add([accepted(dep, f"{base}-1", offset=21)])
    decisions, _ = admitter.run(lambda a: False)
    assert decisions[0].outcome.kind == "done" and not decisions[0].outcome.published
    topic = dep.topics.jobs("normal")
    run_items(start_persister(dep, db, producer), [Republish(f"{base}-1", ((topic, 0, 21),), tenant="t-a")])
    assert job_rows(db, [f"{base}-1"])[f"{base}-1"]["published_at"] is not None
    run_items(
        start_persister(dep, db, producer), [Republish(f"{base}-1", ((topic, 0, 22),), tenant="t-a")]
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
        finish(conn, Terminal(f"{base}-1", "succeeded", values, tenant="t-a"), now)
    topic = dep.topics.jobs("normal")
    persister = start_persister(dep, db, producer)
    persister.submit([Republish(f"{base}-1", ((topic, 0, 41),), tenant="t-a")])
    wait_until(lambda: persister.written >= 1 and persister.depth == 0, timeout_s=60)  # the item is done
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
            finish(conn, Terminal(f"{base}-{n}", "succeeded", values, tenant="t-a"), now)
        conn.execute(jobs.update().where(jobs.c.job_id.like(f"{base}-%")).values(publish_lease_until=now))
    with db.connect() as conn:  # what w-dead sent for job 1 before it died
        result = result_from_row(conn.execute(select(jobs).where(jobs.c.job_id == f"{base}-1")).one())
    producer.send(dep.topics.results, result.job_id, result.model_dump_json().encode()).wait()
    # job 2's id under another tenant: that tenant's `rejected` result is not job 2's result
    other = Rejected(Record("x", 0, 0, None, b"{}", now_ms()), f"{base}-2", "t-b", "high", "invalid", "x")
    producer.send(dep.topics.results, f"{base}-2", other.result().model_dump_json().encode()).wait()
    topic = dep.topics.jobs("normal")
    items = [Republish(f"{base}-{n}", ((topic, 0, 51 + n),), tenant="t-a") for n in (1, 2)]
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
            finish(conn, Terminal(job_id, "succeeded", values, tenant="t-a"), now)
        # job 2's lease lapsed at some point and another worker took the row over
        conn.execute(jobs.update().where(jobs.c.job_id == ids[1]).values(publisher="w-other"))
    persister = Persister(db, producer, dep.topics, "w-test", dead_letter=None, published=None)
    # moments after this worker wrote the leases, nobody can have taken a row over: no round trip
    keys = [("t-a", job_id) for job_id in ids]
    assert persister._keep(keys, claimed=time.monotonic()) == set(keys)
    assert job_rows(db, ids)[ids[0]]["publish_lease_until"] == values["publish_lease_until"]
    # later the table decides: job 1's lease is extended, job 2 is no longer this worker's to publish
    assert persister._keep(keys, claimed=time.monotonic() - LEASE_S) == {keys[0]}
    assert job_rows(db, ids)[ids[0]]["publish_lease_until"] > values["publish_lease_until"]


def test_rows_are_stored_while_the_batch_before_them_waits_for_the_broker(env):
    """Storing and publishing overlap: a batch whose results the broker has not taken yet does not hold up
    the terminal rows of the next one; both results go out once it does, each once, and both records
    are released only after."""
    dep, db, producer = env
    since = now_ms()
    base = f"overlap-{uuid.uuid4().hex[:8]}"
    first, second = (
        _concluded(dep, db, {f"{base}-1": (70, "one")}),
        _concluded(dep, db, {f"{base}-2": (71, "two")}),
    )
    gate, publishing = threading.Event(), threading.Event()

    class SlowBroker:  # the first result's send waits until the test lets it go
        def send(self, topic, key, value, headers=()):
            if key == f"{base}-1":
                publishing.set()
                gate.wait(60)
            return producer.send(topic, key, value, headers)

    persister = start_persister(dep, db, SlowBroker())
    persister.submit(list(first))
    assert publishing.wait(60)  # the first batch is stored, its result on its way
    persister.submit(list(second))
    wait_until(lambda: job_rows(db, [f"{base}-2"])[f"{base}-2"]["status"] == "succeeded", timeout_s=30)
    rows = job_rows(db, [f"{base}-1", f"{base}-2"])
    assert rows[f"{base}-1"]["published_at"] is None and rows[f"{base}-2"]["published_at"] is None
    assert persister.acked() == []  # nothing is released before its result is out
    gate.set()
    wait_until(lambda: persister.depth == 0, timeout_s=60)
    persister.close()
    assert {s for s in persister.acked()} == {
        (dep.topics.jobs("normal"), 0, 70),
        (dep.topics.jobs("normal"), 0, 71),
    }
    assert all(r["published_at"] is not None for r in job_rows(db, [f"{base}-1", f"{base}-2"]).values())
    results = results_by_job(dep, since, 2)
    assert {job_id: [r.output_text for r in rs] for job_id, rs in results.items()} == {
        f"{base}-1": ["one"],
        f"{base}-2": ["two"],
    }


@pytest.fixture
def small_results(settings):
    """A deployment of its own whose results topic takes messages of at most `limit(n)` bytes."""
    dep = make_deployment(settings)
    db = make_engine(dep.database_url)
    producer = Producer(dep.kafka_connection, "inferq-test-small-results", check_sizes=True)  # as workers

    def limit(max_bytes: int) -> None:
        with KafkaAdminClient(bootstrap_servers=dep.kafka) as admin:
            topic = ConfigResource("TOPIC", dep.topics.results, {"max.message.bytes": str(max_bytes)})
            admin.alter_configs([topic])
        # the broker applies a change a moment after it accepted it, and its logs a moment after that
        wait_until(lambda: max_message_bytes(dep.kafka_connection, dep.topics.results) == max_bytes, 30)
        time.sleep(1.0)

    yield dep, db, producer, limit
    producer.close()
    db.dispose()


def _concluded(dep, db, outputs: dict[str, tuple[int, str]]) -> list[Concluded]:
    """Admitted jobs (job_id -> (offset, output)) concluding as succeeded, with metadata in their params."""
    admitter = Admitter(db, "w-test")
    admitter.add([accepted(dep, job_id, offset=offset) for job_id, (offset, _) in outputs.items()])
    admitter.run(lambda a: False)
    with db.begin() as conn:
        conn.execute(jobs.update().where(jobs.c.job_id.in_(list(outputs))).values(
            params={"metadata": {"order": "o-1"}}))  # fmt: skip
    now = datetime.now(UTC)
    topic = dep.topics.jobs("normal")
    return [
        Concluded(
            Terminal(
                job_id,
                "succeeded",
                {"output_text": out, "finish_reason": "stop", "finished_at": now},
                1,
                tenant="t-a",
            ),
            ((topic, 0, offset),),
        )
        for job_id, (offset, out) in outputs.items()
    ]


def test_a_result_too_large_for_the_topic_goes_out_compact_and_the_row_keeps_the_output(small_results):
    """The broker refuses the full result for good: its record is acked only once the compact form (no
    output_text, no metadata, `failed` with the reason) is out; the row keeps the job's outcome."""
    dep, db, producer, limit = small_results
    limit(4000)
    since = now_ms()
    big, small = f"big-{uuid.uuid4().hex[:8]}", f"small-{uuid.uuid4().hex[:8]}"
    items = _concluded(dep, db, {big: (10, "x" * 20_000), small: (11, "fine")})
    topic = dep.topics.jobs("normal")
    assert run_items(start_persister(dep, db, producer), items) == {(topic, 0, 10), (topic, 0, 11)}
    rows = job_rows(db, [big, small])
    assert rows[big]["status"] == "succeeded" and rows[big]["output_text"] == "x" * 20_000
    assert rows[big]["error"].startswith(COMPACT_NOTE) and "bytes" in rows[big]["error"]
    assert all(row["published_at"] is not None for row in rows.values())
    results = results_by_job(dep, since, 2)
    [compact] = results[big]
    assert (compact.status, compact.finish_reason, compact.output_text) == ("failed", "error", None)
    assert compact.metadata == {} and compact.error.startswith(COMPACT_NOTE) and compact.attempt == 1
    with db.connect() as conn:  # whoever publishes the row later builds the very same message
        assert result_from_row(conn.execute(select(jobs).where(jobs.c.job_id == big)).one()) == compact
    assert [(r.status, r.output_text, r.metadata) for r in results[small]] == [
        ("succeeded", "fine", {"order": "o-1"})
    ]


def test_a_result_refused_even_compact_holds_its_record_until_it_goes_out(small_results, monkeypatch):
    dep, db, producer, limit = small_results
    monkeypatch.setattr(persisters, "REFUSED_RETRY_S", 1.0)
    monkeypatch.setattr(producers, "LIMIT_REFRESH_S", 1.0)  # the producer sees a changed limit at once
    limit(200)  # not even the compact form fits
    since = now_ms()
    job_id = f"huge-{uuid.uuid4().hex[:8]}"
    items = _concluded(dep, db, {job_id: (20, "y" * 20_000)})
    topic = dep.topics.jobs("normal")
    persister = start_persister(dep, db, producer)
    persister.submit(items)
    wait_until(lambda: job_rows(db, [job_id])[job_id]["error"] is not None, timeout_s=60)
    # the first try and two retries (each counted in `written`), every one refused: the third began
    # only after the second had acked what it could
    wait_until(lambda: persister.written >= 3, timeout_s=60)
    assert persister.acked() == []  # never acked while its result is not out
    assert job_rows(db, [job_id])[job_id]["published_at"] is None
    limit(1_000_000)  # the operator fixes the topic: the next retry publishes it
    acked: list = []
    wait_until(lambda: acked.extend(persister.acked()) or (topic, 0, 20) in acked, timeout_s=60)
    persister.close()
    row = job_rows(db, [job_id])[job_id]
    assert row["published_at"] is not None and row["output_text"] == "y" * 20_000
    [result] = results_by_job(dep, since, 1)[job_id]
    assert result.status == "failed" and result.output_text is None


def test_the_sweeper_publishes_what_nobody_publishes_and_only_its_own_deployments(env):
    """Rows whose publisher died, and whose records will not come again: the sweeper claims and publishes
    this deployment's, and leaves another deployment's (same database, other topics) to that one."""
    dep, db, producer = env
    since = now_ms()
    base = f"sweep-{uuid.uuid4().hex[:8]}"
    ours, theirs, live = f"{base}-ours", f"{base}-theirs", f"{base}-live"
    admit_jobs(dep, db, "w-dead", {ours: 80, live: 82})
    other = dataclasses.replace(dep, topic_prefix=f"{dep.topic_prefix}x")
    admit_jobs(other, db, "w-dead", {theirs: 81})
    now = datetime.now(UTC)
    values = {"output_text": "left behind", "finish_reason": "stop", "finished_at": now}
    with db.begin() as conn:
        for job_id in (ours, theirs):  # w-dead wrote them and died: their leases lapsed
            finish(
                conn,
                Terminal(
                    job_id,
                    "succeeded",
                    {**values, **claim("w-dead", now - timedelta(minutes=5))},
                    tenant="t-a",
                ),
                now,
            )
        finish(
            conn, Terminal(live, "succeeded", {**values, **claim("w-live", now)}, tenant="t-a"), now
        )  # still publishing
    published = KeyLookup(dep.kafka_connection, "inferq-test-lookup")
    persister = Persister(
        db, producer, dep.topics, "w-test", dead_letter=None, published=published, sweep_s=0.5
    )
    persister.start()
    try:
        wait_until(lambda: job_rows(db, [ours])[ours]["published_at"] is not None, timeout_s=60)
        time.sleep(1.5)  # a few more sweeps
    finally:
        persister.close()
        rows = job_rows(db, [ours, theirs, live])
        with db.begin() as conn:  # nobody serves the other deployment: leave no outbox row behind
            conn.execute(jobs.delete().where(jobs.c.job_id.in_([theirs, live])))
    assert rows[ours]["publisher"] == "w-test"
    assert (rows[theirs]["published_at"], rows[theirs]["publisher"]) == (None, "w-dead")
    assert (rows[live]["published_at"], rows[live]["publisher"]) == (None, "w-live")
    [result] = results_by_job(dep, since, 1)[ours]
    assert (result.status, result.output_text, result.tenant) == ("succeeded", "left behind", "t-a")
