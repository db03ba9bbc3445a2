"""Factories for worker tests: a private topic prefix, worker processes, a client, and row look-ups.

Every test deployment gets its own topic prefix (and so its own consumer group), so tests never see
each other's jobs on the shared local Kafka and PostgreSQL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from sqlalchemy import Engine, create_engine, select

from schemas.jobs import JobResult, TokenEvent
from schemas.tables import TERMINAL_STATUSES, jobs
from workers.client import JobClient
from workers.kafka_io import TopicReader
from workers.kafka_io.records import to_record
from workers.services.kafka import ensure_topics, wait_for_workers
from workers.settings import Settings


def make_deployment(base: Settings) -> Settings:
    settings = dataclasses.replace(base, topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    ensure_topics(settings.kafka_connection, settings.topic_partitions(), settings.replication_factor)
    return settings


@dataclasses.dataclass
class WorkerProcess:
    worker_id: str
    proc: subprocess.Popen
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # never leave a worker behind; the caller sees the non-zero code
            return self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_worker(
    settings: Settings, tmp: Path, worker_id: str, *extra: str, env: dict[str, str] | None = None
) -> WorkerProcess:
    env = {
        **os.environ,
        **(env or {}),
        "INFERQ_TOPIC_PREFIX": settings.topic_prefix,
        "INFERQ_KAFKA": settings.kafka,
        "INFERQ_DATABASE_URL": settings.database_url,
        "OMP_NUM_THREADS": "1",
    }
    log = tmp / f"{worker_id}-{uuid.uuid4().hex[:6]}.log"
    cmd = [sys.executable, "-m", "workers.cli", "worker", "--worker-id", worker_id, "--drain-timeout", "10"]
    cmd += ["--model", "tiny", *extra]  # the random model: fast, and these tests check delivery, not text
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return WorkerProcess(worker_id, proc, log)


def job_rows(db: Engine, job_ids: Iterable[str]) -> dict[str, dict]:
    with db.connect() as conn:
        result = conn.execute(select(jobs).where(jobs.c.job_id.in_(list(job_ids))))
        return {r.job_id: dict(r._mapping) for r in result}


def tenant_rows(db: Engine, job_id: str) -> dict[str, dict]:
    """Every tenant's row of one job id, by tenant (job ids are scoped by tenant)."""
    with db.connect() as conn:
        result = conn.execute(select(jobs).where(jobs.c.job_id == job_id))
        return {r.tenant: dict(r._mapping) for r in result}


def wait_tenant_rows(db: Engine, job_id: str, tenants: set[str], timeout_s: float = 180) -> dict[str, dict]:
    """Until these tenants' rows of one job id are all terminal; every tenant's row of it, by tenant."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = tenant_rows(db, job_id)
        if tenants <= set(rows) and all(rows[t]["status"] in TERMINAL_STATUSES for t in tenants):
            return rows
        time.sleep(0.2)
    raise AssertionError(f"{job_id}: rows of {sorted(tenants)} not terminal: {tenant_rows(db, job_id)}")


def wait_terminal(db: Engine, job_ids: list[str], timeout_s: float = 180) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = job_rows(db, job_ids)
        if len(rows) == len(job_ids) and all(r["status"] in TERMINAL_STATUSES for r in rows.values()):
            return rows
        if time.monotonic() > deadline:
            missing = {
                j: rows.get(j, {}).get("status")
                for j in job_ids
                if j not in rows or rows[j]["status"] not in TERMINAL_STATUSES
            }
            raise AssertionError(f"jobs not terminal after {timeout_s}s: {missing}")
        time.sleep(0.25)


def wait_status(db: Engine, job_id: str, status: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = job_rows(db, [job_id]).get(job_id)
        if row is not None and row["status"] == status:
            return row
        time.sleep(0.1)
    raise AssertionError(f"{job_id} never reached {status}: {job_rows(db, [job_id]).get(job_id)}")


def read_topic(settings: Settings, topic: str, since_ms: int, until: callable, timeout_s: float = 60) -> list:
    """Records of a whole topic from a time on, until `until(records)` holds (or the timeout)."""
    reader = TopicReader(settings.kafka_connection, topic, since_ms, "inferq-test")
    records: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not until(records):
            records += reader.poll(0.2)
    finally:
        reader.close()
    return records


def read_topic_to_end(settings: Settings, topic: str, since_ms: int, timeout_s: float = 60) -> list:
    """Every record of every partition of a topic from a time on, up to each partition's end offset as of
    the call: what an absence is checked against (reading until some other record arrives can leave a
    partition unread)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        **settings.kafka_connection.client_options(), client_id="inferq-test", enable_auto_commit=False
    )
    records: list = []
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        assert tps, f"no partitions known for {topic}"
        consumer.assign(tps)
        ends = consumer.end_offsets(tps)
        starts = consumer.offsets_for_times(dict.fromkeys(tps, since_ms))
        for tp in tps:
            consumer.seek(tp, starts[tp].offset if starts[tp] is not None else ends[tp])
        deadline = time.monotonic() + timeout_s
        while unread := [tp for tp in tps if consumer.position(tp) < ends[tp]]:
            assert time.monotonic() < deadline, f"{unread} not read to their end offsets {ends}"
            records += [to_record(r) for rs in consumer.poll(timeout_ms=200).values() for r in rs]
    finally:
        consumer.close(autocommit=False)
    return records


def results_by_job(
    settings: Settings, since_ms: int, expected: int, settle_s: float = 1.0
) -> dict[str, list]:
    """Every JobResult on the results topic since a time, by job_id, once `expected` have arrived and
    nothing more came within `settle_s` (a second result for a job would be a bug, so wait for it)."""
    records = read_topic(settings, settings.topics.results, since_ms, lambda rs: len(rs) >= expected)
    time.sleep(settle_s)
    records += read_topic(settings, settings.topics.results, since_ms, lambda rs: False, timeout_s=1)[
        len(records) :
    ]
    out: dict[str, list] = {}
    for r in records:
        result = JobResult.model_validate_json(r.value)
        out.setdefault(result.job_id, []).append(result)
    return out


def token_events(records: list) -> dict[str, list[TokenEvent]]:
    by_job: dict[str, list[TokenEvent]] = {}
    for r in records:
        event = TokenEvent.model_validate_json(r.value)
        by_job.setdefault(event.job_id, []).append(event)
    return by_job


def client_for(settings: Settings) -> JobClient:
    return JobClient(settings)


def now_ms() -> int:
    return int(time.time() * 1000) - 2000


def wait_group_members(settings: Settings, count: int, timeout_s: float = 120) -> None:
    """Until the deployment's consumer group is stable with `count` members (workers have joined)."""
    wait_for_workers(settings, count, timeout_s)


def wait_until(condition, timeout_s: float = 120) -> None:
    """Until condition() holds, polling every 0.2 s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.2)


@contextlib.contextmanager
def serving_worker(
    settings: Settings, tmp: Path, worker_id: str, *extra: str, env: dict[str, str] | None = None
):
    """A private deployment with one worker, a client and a database engine; the worker must exit 0."""
    dep = make_deployment(settings)
    worker = start_worker(dep, tmp, worker_id, *extra, env=env)
    client = JobClient(dep)
    db = create_engine(dep.database_url)
    try:
        yield dep, client, db, worker
    finally:
        client.close()
        db.dispose()
        assert worker.stop() == 0, worker.output()[-3000:]
