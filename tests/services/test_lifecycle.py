"""`up` / `status` / `down` and crash recovery, on a private instance (own state dir and ports)."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import psutil
import pytest
from sqlalchemy import create_engine, insert, select

from schemas.tables import jobs
from tests.services.factories import PrivateServices, make_private_services

pytestmark = [pytest.mark.services, pytest.mark.slow]


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory):
    services = make_private_services(tmp_path_factory.mktemp("state"))
    try:
        yield services
    finally:
        services.cli("down", "--purge", check=False)


@pytest.fixture
def running(private: PrivateServices) -> PrivateServices:
    private.cli("up")
    return private


def _kill9(pid: int) -> None:
    proc = psutil.Process(pid)
    proc.kill()
    proc.wait(30)


def test_up_twice_is_a_no_op_and_down_stops_exactly_what_up_started(running: PrivateServices) -> None:
    first = running.status()
    again = running.cli("up")
    assert "kafka: already running" in again.stdout
    assert "postgres: already running" in again.stdout
    assert running.status() == first
    assert all(s["healthy"] and s["managed"] for s in first.values())

    running.cli("down")
    stopped = running.status()
    assert not any(s["healthy"] or s["pid"] for s in stopped.values())
    assert not any(psutil.pid_exists(s["pid"]) for s in first.values())

    running.cli("up")
    restarted = running.status()
    assert all(s["healthy"] for s in restarted.values())
    assert {s["pid"] for s in restarted.values()}.isdisjoint(s["pid"] for s in first.values())


def test_killed_broker_is_detected_and_restarted_keeping_committed_messages(running: PrivateServices) -> None:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    bootstrap = running.settings.kafka
    topic = running.settings.topics.jobs("normal")
    value = uuid.uuid4().bytes
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    sent = producer.send(topic, key=b"k", value=value).get(timeout=30)
    producer.close()

    _kill9(running.status()["kafka"]["pid"])
    assert running.status()["kafka"] == {**running.status()["kafka"], "healthy": False, "pid": None}
    running.cli("up")
    assert running.status()["kafka"]["healthy"]

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=20000)
    tp = TopicPartition(topic, sent.partition)
    consumer.assign([tp])
    consumer.seek(tp, sent.offset)
    record = next(iter(consumer))
    consumer.close()
    assert (record.offset, record.value) == (sent.offset, value)


def test_killed_database_is_detected_and_restarted_keeping_committed_rows(running: PrivateServices) -> None:
    url = running.settings.database_url
    job_id = f"crash-{uuid.uuid4()}"
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(insert(jobs).values(job_id=job_id, priority="normal", status="queued"))
    engine.dispose()

    _kill9(running.status()["postgres"]["pid"])
    postgres = running.status()["postgres"]
    assert (postgres["healthy"], postgres["pid"]) == (False, None)
    running.cli("up")
    assert running.status()["postgres"]["healthy"]

    engine = create_engine(url)
    with engine.connect() as conn:
        status = conn.execute(select(jobs.c.status).where(jobs.c.job_id == job_id)).scalar_one()
    engine.dispose()
    assert status == "queued"


def test_the_state_of_running_services_is_owner_only(running: PrivateServices) -> None:
    """Logs, pid files, Kafka's segments (prompts) and the password: nothing readable by anyone else."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=running.settings.kafka, acks="all")
    producer.send(running.settings.topics.jobs("normal"), key=b"k", value=b"a prompt").get(timeout=30)
    producer.close()

    state = running.settings.state_dir
    found = [Path(root) / name for root, dirs, files in os.walk(state) for name in dirs + files]
    assert any(p.suffix == ".log" and p.parent.parent == state / "kafka" / "data" for p in found)  # segments
    loose = [f"{p} {_mode(p):o}" for p in [state, *found] if not p.is_symlink() and _mode(p) & 0o077]
    assert not loose
    home = (state / "postgres").resolve()  # the cluster's own folder, owned by the server's user
    assert (_mode(home), _mode(home / "data")) == (0o700, 0o700)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)
