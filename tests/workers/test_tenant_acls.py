"""Tenant isolation on a real SASL_SSL broker with an authorizer and ACLs (INFERQ_TENANT_TOPICS=1).

Tenants A and B are SCRAM users whose only rights are the ACLs `inferq tenant add` grants; the worker runs
as the broker's super user. B's principal cannot post as A, cancel A's job or read A's output: the broker
refuses what B may not touch, and the worker believes the tenant a topic names, never the one a message
claims. Two tenants' jobs of one id are two jobs, each with its own row and result.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import pytest
from kafka import KafkaAdminClient
from kafka.errors import TopicAuthorizationFailedError
from sqlalchemy import create_engine

from tests.services.secure_kafka import start_secure_broker
from tests.workers.worker_factories import (
    read_topic,
    start_worker,
    tenant_rows,
    wait_tenant_rows,
)
from workers.client import JobClient
from workers.kafka_io import Producer
from workers.kafka_io.tenants import add_tenant
from workers.services.kafka import ensure_topics

pytestmark = [pytest.mark.services, pytest.mark.slow]

TENANTS = {"tenant-a": "secret-of-a", "tenant-b": "secret-of-b"}


@pytest.fixture(scope="module")
def broker(settings, tmp_path_factory):
    broker = start_secure_broker(tmp_path_factory.mktemp("acl-kafka"), settings.cache_dir, TENANTS)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def deployment(settings, broker, tmp_path_factory):
    """One worker (a super user) serving tenants A and B, each with its own client (its own principal)."""
    admin = broker.connection()
    dep = dataclasses.replace(
        settings,
        kafka=admin.bootstrap,
        kafka_security=admin.security,
        topic_prefix=f"a{uuid.uuid4().hex[:10]}",
        tenant_topics=True,
    )
    ensure_topics(dep.kafka_connection, dep.topic_partitions())  # the shared dead-letter topic
    for tenant, user in (("A", "tenant-a"), ("B", "tenant-b")):
        add_tenant(
            dep.kafka_connection, dep.topics, tenant, f"User:{user}", jobs_partitions=2, stream_partitions=2
        )
    env = {**broker.env(), "INFERQ_TENANT_TOPICS": "1"}
    worker = start_worker(dep, tmp_path_factory.mktemp("acl-worker"), "w-acl", env=env)
    as_a, as_b = (
        dataclasses.replace(dep, kafka_security=broker.connection(TENANTS[u], u).security)
        for u in ("tenant-a", "tenant-b")
    )
    clients = JobClient(as_a), JobClient(as_b)
    db = create_engine(dep.database_url)
    try:
        yield dep, as_a, as_b, clients, db, worker
    finally:
        for client in clients:
            client.close()
        db.dispose()
        assert worker.stop() == 0, worker.output()[-3000:]


def refused(attempt) -> BaseException:
    """What the broker answered an attempt that must be refused (it fails the test if it went through)."""
    try:
        attempt()
    except Exception as exc:  # noqa: BLE001 - what the refusal looks like is asserted by the caller
        return exc
    raise AssertionError("the broker allowed it")


def post(conn_settings, topic: str, value: dict, key: str = "k") -> None:
    producer = Producer(conn_settings.kafka_connection, "acl-test", max_block_s=10)
    try:
        producer.send(topic, key, json.dumps(value).encode()).wait(20)
    finally:
        producer.close(5)


def read(conn_settings, topic: str) -> list:
    """What a principal reads of a whole topic (raises if the broker refuses it)."""
    return read_topic(conn_settings, topic, 0, lambda rs: len(rs) > 0, timeout_s=8)


def describe_error(conn_settings, topic: str) -> int:
    """The broker's error code when the principal asks about the topic (29: TopicAuthorizationFailed)."""
    admin = KafkaAdminClient(**conn_settings.kafka_connection.client_options(), client_id="acl-test")
    try:
        [described] = admin.describe_topics([topic])
    finally:
        admin.close()
    return described["error_code"]


def test_both_tenants_jobs_of_one_id_run_each_for_its_own_tenant(deployment):
    dep, as_a, as_b, (a, b), db, _ = deployment
    job_id = f"same-{dep.topic_prefix}"
    a.submit({"job_id": job_id, "tenant": "A", "prompt": "A's prompt", "max_tokens": 9})
    b.submit({"job_id": job_id, "tenant": "B", "prompt": "B's prompt", "max_tokens": 4})
    rows = wait_tenant_rows(db, job_id, {"A", "B"})
    assert {t: (r["status"], r["completion_tokens"]) for t, r in rows.items()} == {
        "A": ("succeeded", 9),
        "B": ("succeeded", 4),
    }
    result_a, result_b = a.wait(job_id, timeout_s=60), b.wait(job_id, timeout_s=60)
    assert (result_a.tenant, result_a.output_text) == ("A", rows["A"]["output_text"])
    assert (result_b.tenant, result_b.output_text) == ("B", rows["B"]["output_text"])
    assert "".join(e.text for e in a.stream(job_id, timeout_s=60)) == result_a.output_text
    # each result went to its own tenant's topic only
    on_a = read_topic(dep, dep.topics.tenant_results("A"), 0, lambda rs: len(rs) >= 1, timeout_s=10)
    assert {json.loads(r.value)["tenant"] for r in on_a} == {"A"}


def test_b_cannot_post_as_a(deployment):
    dep, as_a, as_b, (a, b), db, _ = deployment
    # on A's topics the broker refuses B's principal
    exc = refused(lambda: post(as_b, dep.topics.tenant_jobs("A", "high"), {"prompt": "as A"}))
    assert isinstance(exc, TopicAuthorizationFailedError), repr(exc)
    # on its own topic, a message claiming to be A's is B's, rejected with the reason
    job_id = f"claims-a-{dep.topic_prefix}"
    post(as_b, dep.topics.tenant_jobs("B", "high"), {"job_id": job_id, "tenant": "A", "prompt": "x"}, job_id)
    rows = wait_tenant_rows(db, job_id, {"B"})
    assert set(rows) == {"B"} and rows["B"]["status"] == "rejected"
    assert "tenant 'A' does not match the topic's tenant 'B'" in rows["B"]["error"]
    result = b.wait(job_id, timeout_s=60, tenant="B")
    assert result.status == "rejected" and "does not match" in result.error


def test_b_cannot_cancel_as_a(deployment):
    dep, as_a, as_b, (a, b), db, _ = deployment
    job_id = f"keep-{dep.topic_prefix}"
    a.submit({"job_id": job_id, "tenant": "A", "prompt": "A's long job", "max_tokens": 300})
    deadline = time.monotonic() + 120
    while tenant_rows(db, job_id).get("A", {}).get("status") != "running":
        assert time.monotonic() < deadline, tenant_rows(db, job_id)
        time.sleep(0.1)
    # A's control topic refuses B; on B's own, a cancel naming A is refused, and B's cancel of that id
    # is a cancel of B's job of that id (which it does not have), not of A's
    exc = refused(lambda: post(as_b, dep.topics.tenant_control("A"), {"type": "cancel", "job_id": job_id}))
    assert isinstance(exc, TopicAuthorizationFailedError), repr(exc)
    post(as_b, dep.topics.tenant_control("B"), {"type": "cancel", "job_id": job_id, "tenant": "A"}, job_id)
    b.cancel(job_id, tenant="B")
    rows = wait_tenant_rows(db, job_id, {"A", "B"})
    assert (rows["A"]["status"], rows["A"]["completion_tokens"]) == ("succeeded", 300)
    assert rows["A"]["cancel_requested_at"] is None
    assert rows["B"]["status"] == "cancelled"  # B's own (empty) id: nothing of A's
    # A's own cancel works
    other = f"stop-{dep.topic_prefix}"
    a.submit({"job_id": other, "tenant": "A", "prompt": "stop me", "max_tokens": 2000})
    while tenant_rows(db, other).get("A", {}).get("status") != "running":
        assert time.monotonic() < deadline + 120
        time.sleep(0.1)
    a.cancel(other)
    assert wait_tenant_rows(db, other, {"A"})["A"]["status"] == "cancelled"


def test_b_cannot_read_as_output(deployment):
    dep, as_a, as_b, (a, b), db, _ = deployment
    job_id = f"private-{dep.topic_prefix}"
    a.submit({"job_id": job_id, "tenant": "A", "prompt": "A's secret", "max_tokens": 3})
    a.wait(job_id, timeout_s=120)
    for topic in (dep.topics.tenant_results("A"), dep.topics.tenant_tokens("A")):
        assert read(as_a, topic), topic  # A reads its own output; B, with the same reader, is refused
        exc = refused(lambda topic=topic: read(as_b, topic))
        assert isinstance(exc, TopicAuthorizationFailedError), (topic, repr(exc))
        assert describe_error(as_b, topic) == TopicAuthorizationFailedError.errno
        assert describe_error(as_a, topic) == 0
    # a tenant may not read what workers read: its own jobs (it may only post them), the dead letters
    exc = refused(lambda: read(as_a, dep.topics.tenant_jobs("A", "normal")))
    assert isinstance(exc, TopicAuthorizationFailedError), repr(exc)
    assert describe_error(as_a, dep.topics.dlq) == TopicAuthorizationFailedError.errno


def test_a_tenant_added_while_the_worker_runs_is_served_without_a_restart(deployment):
    dep, as_a, as_b, (a, b), db, worker = deployment
    add_tenant(dep.kafka_connection, dep.topics, "C", "User:tenant-c", jobs_partitions=1, stream_partitions=1)
    job_id = f"late-tenant-{dep.topic_prefix}"
    # posted as the super user onto C's topic: the worker's pattern subscription finds the new topic
    post(
        dep,
        dep.topics.tenant_jobs("C", "normal"),
        {"job_id": job_id, "prompt": "new here", "max_tokens": 3},
        job_id,
    )
    rows = wait_tenant_rows(db, job_id, {"C"}, timeout_s=180)
    assert (rows["C"]["status"], rows["C"]["completion_tokens"]) == ("succeeded", 3)
    assert worker.proc.poll() is None
    # and its output is on C's results topic, which A's principal may not read
    assert read(dep, dep.topics.tenant_results("C"))
    exc = refused(lambda: read(as_a, dep.topics.tenant_results("C")))
    assert isinstance(exc, TopicAuthorizationFailedError), repr(exc)
