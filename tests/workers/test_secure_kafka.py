"""Every Kafka client of inferq over SASL_SSL (SCRAM-SHA-256) with certificates made by the test: topics
created, a job submitted, its tokens streamed and its result read, by a worker configured from the
INFERQ_KAFKA_* environment alone."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from sqlalchemy import create_engine

from tests.services.secure_kafka import start_secure_broker
from tests.workers.worker_factories import start_worker, wait_terminal
from workers.client import JobClient
from workers.services.kafka import ensure_topics, ping

pytestmark = [pytest.mark.services, pytest.mark.slow]


@pytest.fixture(scope="module")
def broker(settings, tmp_path_factory):
    broker = start_secure_broker(tmp_path_factory.mktemp("secure-kafka"), settings.cache_dir)
    try:
        yield broker
    finally:
        broker.stop()


def test_submit_stream_and_result_over_sasl_ssl(settings, broker, tmp_path):
    conn = broker.connection()
    dep = dataclasses.replace(
        settings, kafka=conn.bootstrap, kafka_security=conn.security, topic_prefix=f"s{uuid.uuid4().hex[:10]}"
    )
    ensure_topics(dep.kafka_connection, dep.topic_partitions())
    assert not ping(broker.connection(password="wrong"))  # SCRAM really checks
    worker = start_worker(dep, tmp_path, "w-secure", env=broker.env())
    client = JobClient(dep)
    db = create_engine(dep.database_url)
    try:
        job_id = client.submit(
            {"job_id": f"secure-{dep.topic_prefix}", "prompt": "over TLS", "max_tokens": 12}
        ).job_id
        events = list(client.stream(job_id, timeout_s=180))
        result = client.wait(job_id, timeout_s=60)
        row = wait_terminal(db, [job_id])[job_id]
        assert result.status == row["status"] == "succeeded"
        assert "".join(e.text for e in events) == result.output_text == row["output_text"]
        assert events[-1].finish_reason == result.finish_reason
        assert worker.proc.poll() is None
    finally:
        client.close()
        db.dispose()
        assert worker.stop() == 0, worker.output()[-3000:]
