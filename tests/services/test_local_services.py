"""The shared services of `inferq up` answer as the rest of the project expects. Other people use them
at the same time: scratch topics and unique keys only, nothing is stopped or left behind."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import delete, insert, select

from schemas.tables import jobs
from tests.services.factories import run_cli
from workers.settings import Settings

pytestmark = pytest.mark.services


@pytest.fixture
def scratch_topic(settings: Settings):
    from kafka.admin import KafkaAdminClient

    name = f"{settings.topic_prefix}-test.{uuid.uuid4().hex[:12]}"
    with KafkaAdminClient(bootstrap_servers=settings.kafka) as admin:
        admin.create_topics({name: {"num_partitions": 2, "replication_factor": 1}}, wait_for_metadata=True)
        try:
            yield name
        finally:
            admin.delete_topics([name])


def test_kafka_round_trip_through_a_consumer_group(settings: Settings, scratch_topic: str) -> None:
    from kafka import KafkaConsumer, KafkaProducer

    sent = {f"job-{i}".encode(): uuid.uuid4().bytes for i in range(5)}
    producer = KafkaProducer(bootstrap_servers=settings.kafka)
    for key, value in sent.items():
        producer.send(scratch_topic, key=key, value=value)
    producer.flush()
    producer.close()

    consumer = KafkaConsumer(
        scratch_topic,
        bootstrap_servers=settings.kafka,
        group_id=scratch_topic,
        auto_offset_reset="earliest",
        consumer_timeout_ms=20000,
    )
    received = {}
    for record in consumer:
        received[record.key] = record.value
        if len(received) == len(sent):
            break
    consumer.commit()
    consumer.close()
    assert received == sent


def test_contract_topics_exist_with_their_partition_counts(settings: Settings) -> None:
    from kafka.admin import KafkaAdminClient

    expected = settings.topics.partitions()
    with KafkaAdminClient(bootstrap_servers=settings.kafka) as admin:
        found = {t["name"]: len(t["partitions"]) for t in admin.describe_topics(list(expected))}
    assert found == expected
    assert all(found[t] >= 4 for t in settings.topics.all_jobs)


def test_postgres_round_trip_through_sqlalchemy(db_engine) -> None:
    job_id = f"roundtrip-{uuid.uuid4()}"
    with db_engine.begin() as conn:
        conn.execute(
            insert(jobs).values(
                job_id=job_id,
                tenant="t1",
                priority="low",
                status="queued",
                params={"max_tokens": 8, "stop": ["\n"]},
            )
        )
    try:
        with db_engine.connect() as conn:
            row = conn.execute(select(jobs).where(jobs.c.job_id == job_id)).one()
        assert (row.tenant, row.status, row.attempts) == ("t1", "queued", 0)
        assert row.params == {"max_tokens": 8, "stop": ["\n"]}
        assert row.created_at.tzinfo is not None
    finally:
        with db_engine.begin() as conn:
            conn.execute(delete(jobs).where(jobs.c.job_id == job_id))


def test_status_json_reports_settings_and_health(settings: Settings, tmp_path) -> None:
    done = run_cli("status", "--json", cwd=tmp_path)  # from any cwd
    doc = json.loads(done.stdout)
    assert doc["settings"]["kafka"] == settings.kafka
    assert doc["settings"]["topic_prefix"] == settings.topic_prefix
    assert doc["topics"] == settings.topics.partitions()
    assert {name: s["healthy"] for name, s in doc["services"].items()} == {"kafka": True, "postgres": True}
