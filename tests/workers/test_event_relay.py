"""The relay process: its framing, token events and results through it to the real broker, across its death,
and the errors it answers rebuilt as the Kafka client's own."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest

from schemas.jobs import TokenEvent
from tests.workers.late_topics import CountingProducer, late_topic
from tests.workers.worker_factories import make_deployment, now_ms, read_topic, token_events, wait_until
from workers.serving.streaming import relay as event_relay
from workers.serving.streaming.sender import TokenEventSender, relay_environment
from workers.settings import KafkaConnection


def test_frames_round_trip_and_a_frame_cut_short_ends_the_stream():
    headers = [("job_id", b"job-1"), ("tenant", "accént".encode()), ("empty", b"")]
    stream = event_relay.message_frame(7, b"job-1", b'{"x": 1}', headers)
    stream += event_relay.message_frame(0, b"job-3", b"{}") + event_relay.reply_frame(7, 1, "broker away")
    stream += event_relay.message_frame(9, b"job-4", b"{}", topic="t.results", durable=True)
    cut = event_relay.message_frame(0, b"job-2", b"{}")[:-1]
    payloads = list(event_relay.read_frames(io.BytesIO(stream + cut)))
    assert len(payloads) == 4
    assert event_relay.parse_message(payloads[0]) == event_relay.Message(7, b"job-1", b'{"x": 1}', headers)
    assert event_relay.parse_message(payloads[1]) == event_relay.Message(0, b"job-3", b"{}", [])
    assert event_relay.parse_reply(payloads[2]) == (7, 1, "broker away")
    durable = event_relay.Message(9, b"job-4", b"{}", [], topic="t.results", durable=True)
    assert event_relay.parse_message(payloads[3]) == durable


def test_an_answered_error_is_rebuilt_as_the_client_would_raise_it():
    """The persister tells a broker that is away (retry) from a record it refuses (replace or give up)
    by the error's class: an answer from the relay must keep it."""
    from kafka.errors import KafkaTimeoutError, MessageSizeTooLargeError

    from workers.kafka_io.errors import kafka_too_large
    from workers.serving.errors import is_transient

    too_large = event_relay.error_of(event_relay.error_text(MessageSizeTooLargeError("1 MB is too much")))
    assert isinstance(too_large, MessageSizeTooLargeError) and kafka_too_large(too_large)
    assert "1 MB is too much" in str(too_large)
    away = event_relay.error_of(event_relay.error_text(KafkaTimeoutError("no answer")))
    assert isinstance(away, KafkaTimeoutError) and is_transient(away)
    assert is_transient(event_relay.error_of(event_relay.error_text(ConnectionError("reset"))))
    unknown = event_relay.error_of("SomethingNew\nwhy")  # no such class: never taken for transient
    assert isinstance(unknown, RuntimeError) and not is_transient(unknown) and "why" in str(unknown)


def _event(job_id: str, seq: int, final: bool = False) -> TokenEvent:
    finish = "stop" if final else None
    text = f"t{seq}"
    return TokenEvent(job_id=job_id, attempt=1, seq=seq, text=text, token_ids=[seq], finish_reason=finish)


def _confirmed(sent) -> bool:
    try:
        sent.wait(5)
    except (ConnectionError, TimeoutError):
        return False
    return True


@pytest.mark.services
def test_a_topics_first_event_waits_for_its_metadata_rather_than_being_dropped(settings, monkeypatch):
    """A busy broker can take longer than a send's block (0.5 s, meant for a broker that is away) to give a
    topic's metadata: a fresh worker's first token events were then dropped, its streams empty (seen once
    under the suite's load). A topic's first send waits for its metadata, once: here a topic of the real
    broker that appears only after the relay's first look-ups timed out."""
    import workers.kafka_io as kafka_io

    made: list[CountingProducer] = []

    def producer(*args, **kwargs) -> CountingProducer:  # the real one, counting its metadata timeouts
        made.append(CountingProducer(*args, **kwargs))
        return made[-1]

    class Replies:
        def __init__(self) -> None:
            self.dropped: list[tuple[int, str]] = []

        def send(self, track: int, outcome: int, message: str = "") -> None:
            if outcome == event_relay.DROPPED:
                self.dropped.append((track, message))

    monkeypatch.setattr(kafka_io, "Producer", producer)
    monkeypatch.setattr(event_relay, "FIRST_METADATA_S", 120.0)  # a loaded broker may take its time
    frames = event_relay.message_frame(0, b"job-1", b"{}") + event_relay.message_frame(0, b"job-2", b"{}")
    replies = Replies()
    with late_topic(settings) as (topic, release):
        run = threading.Thread(
            target=event_relay.relay,
            args=(topic, "relay-test", settings.kafka_connection, io.BytesIO(frames), replies),
        )
        run.start()
        wait_until(lambda: (made and made[0].misses >= 1) or not run.is_alive(), timeout_s=60)
        assert run.is_alive(), f"the relay did not wait for {topic}: {replies.dropped}"
        since = now_ms()
        release()
        run.join(120)
        assert not run.is_alive()
        records = read_topic(settings, topic, since, lambda rs: len(rs) >= 2)
    assert replies.dropped == []
    assert [r.key for r in records] == [b"job-1", b"job-2"]


def test_a_topic_whose_metadata_is_refused_is_answered_not_fatal(monkeypatch):
    """Waiting for a topic's metadata can fail for good (not authorized): the relay goes on and answers
    the message with the send's own error, as before the wait existed."""
    from kafka.errors import TopicAuthorizationFailedError

    import workers.kafka_io as kafka_io

    class RefusingProducer:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def await_topic(self, topic: str, timeout_s: float) -> bool:
            raise TopicAuthorizationFailedError(topic)

        def send(self, topic, key, value, headers=(), check_size=None):
            raise TopicAuthorizationFailedError(topic)

        def flush(self, timeout_s=None) -> None:
            pass

        def close(self, timeout_s=10.0) -> None:
            pass

    answers: list[tuple[int, int, str]] = []

    class Replies:
        def send(self, track: int, outcome: int, message: str = "") -> None:
            answers.append((track, outcome, message))

    monkeypatch.setattr(kafka_io, "Producer", RefusingProducer)
    frames = event_relay.message_frame(5, b"job-1", b"{}", topic="t.results", durable=True)
    frames += event_relay.message_frame(6, b"job-1", b"{}", topic="t.results", durable=True)
    event_relay.relay("t.tokens", "relay-test", KafkaConnection("127.0.0.1:1"), io.BytesIO(frames), Replies())
    assert [(track, outcome) for track, outcome, _ in answers] == [
        (5, event_relay.FAILED),
        (6, event_relay.FAILED),
    ]
    assert all(message.startswith("TopicAuthorizationFailedError") for _, _, message in answers)


def test_events_arrive_in_order_and_a_killed_relay_is_replaced(settings):
    dep = make_deployment(settings)
    since, job = now_ms(), f"relay-{uuid.uuid4().hex[:8]}"
    drops: list[int] = []
    conn, topic = dep.kafka_connection, dep.topics.tokens
    sender = TokenEventSender(conn, "inferq-test-relay", topic, drops.append)
    try:
        for seq in range(200):
            sender.send(_event(job, seq), "acme")
        sender.send(_event(job, 200, final=True), "acme", track=True).wait(30)  # confirmed by the broker

        relay = psutil.Process(sender._relay.proc.pid)
        relay.kill()
        relay.wait(10)
        # a write finds the relay dead and starts a new one (an event written into the dying one is dropped)
        wait_until(lambda: _confirmed(sender.send(_event(f"{job}-b", 0), track=True)), timeout_s=60)
        assert sender._relay.proc.pid != relay.pid
        for seq in range(1, 50):
            sender.send(_event(f"{job}-b", seq))
        sender.send(_event(f"{job}-b", 50, final=True), track=True).wait(30)
    finally:
        sender.close()
    records = read_topic(dep, dep.topics.tokens, since, lambda rs: len(rs) >= 252)
    events = token_events(records)
    assert [e.seq for e in events[job]] == list(range(201))
    expected = (("job_id", job.encode()), ("attempt", b"1"), ("tenant", b"acme"))
    assert {r.headers for r in records if r.key == job.encode()} == {expected}
    after = [e.seq for e in events[f"{job}-b"]]
    assert after[-50:] == list(range(1, 51)) and set(after[:-50]) == {0}  # the probes that got through


@pytest.mark.services
def test_close_stops_the_relay_process(settings):
    dep = make_deployment(settings)
    sender = TokenEventSender(dep.kafka_connection, "inferq-test-relay", dep.topics.tokens)
    pid = sender._relay.proc.pid
    sender.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("niceness", [0, 7])
def test_the_relay_runs_as_much_nicer_than_its_worker_as_asked(niceness):
    """Its CPU priority below the worker's: where cores are short, the engine loop gets one first. Read once
    the relay is past the point where it sets its priority (it ignores SIGINT and SIGTERM right after), so
    niceness 0 is checked too: a relay that ignored the setting, or took a default for 0, would show."""
    sender = TokenEventSender(KafkaConnection("127.0.0.1:9"), "inferq-test", "nowhere", niceness=niceness)
    try:
        pid, ours = sender._relay.proc.pid, os.getpriority(os.PRIO_PROCESS, 0)
        wait_until(lambda: _ignored_signals(pid) >= {signal.SIGINT, signal.SIGTERM}, timeout_s=60)
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, ours + niceness)
        assert sender._relay.proc.poll() is None
    finally:
        sender.close(timeout_s=1.0)


def _ignored_signals(pid: int) -> set[int]:
    """The signals a process ignores (SigIgn of /proc/PID/status, a bit mask by signal number)."""
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def test_a_relay_waiting_for_an_absent_broker_exits_when_its_worker_is_killed(tmp_path):
    script = (
        "import time\n"
        "from workers.serving.streaming.sender import TokenEventSender\n"
        "from workers.settings import KafkaConnection\n"
        "s = TokenEventSender(KafkaConnection('127.0.0.1:9'), 'inferq-test', 'nowhere')\n"
        "print(s._relay.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        relay = psutil.Process(int(parent.stdout.readline()))
        time.sleep(1.0)
        assert relay.is_running() and relay.status() != psutil.STATUS_ZOMBIE  # still waiting for Kafka
        parent.kill()
        parent.wait(10)
        relay.wait(15)  # gone within the watcher's period, not when the broker comes back
    finally:
        parent.kill()


SECRETS = {
    "INFERQ_DATABASE_URL": "postgresql+psycopg2://postgres:db-password-7f3a@127.0.0.1:15432/inferq",
    "INFERQ_KAFKA_SASL_PASSWORD": "sasl-password-7f3a",  # travels in the relay's connection when it is used
    "INFERQ_CELERY_BROKER": "redis://:celery-password-7f3a@redis:6379/0",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-7f3a",
}


def test_the_relay_environment_keeps_only_what_runs_python():
    env = {**SECRETS, "PATH": "/usr/bin", "PYTHONPATH": "/src", "LC_ALL": "C.UTF-8", "HF_TOKEN": "hf-7f3a"}
    relay_env = relay_environment(KafkaConnection("127.0.0.1:9"), env)
    assert set(relay_env) == {"PATH", "PYTHONPATH", "LC_ALL", event_relay.ENV_CONNECTION}
    assert "7f3a" not in repr(relay_env)


def test_the_relay_process_inherits_no_secrets_of_the_worker(monkeypatch):
    """Read from the running child: the database password and other credentials stay in the worker."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("INFERQ_KAFKA", "127.0.0.1:9")
    sender = TokenEventSender(KafkaConnection("127.0.0.1:9"), "inferq-test", "nowhere")  # no broker needed
    try:
        with open(f"/proc/{sender._relay.proc.pid}/environ", "rb") as f:
            environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if item)
        assert sender._relay.proc.poll() is None  # a relay that started with it
    finally:
        sender.close(timeout_s=1.0)
    names = {name.decode() for name in environ}
    assert not names & {*SECRETS, "INFERQ_KAFKA"}
    assert b"7f3a" not in b"".join(environ.values())
    assert not {n for n in names if any(w in n for w in ("PASSWORD", "SECRET", "TOKEN", "DATABASE"))}


@pytest.mark.services
def test_results_through_the_relay_are_answered_with_the_brokers_outcome(settings):
    """Durable messages (results): delivered ones are confirmed; one too large for its topic comes back as
    the client's own MessageSizeTooLargeError (the persister then sends its compact form); one the relay
    died holding comes back as a lost connection (retried), and the next send starts a new relay."""
    from kafka.admin import KafkaAdminClient
    from kafka.errors import MessageSizeTooLargeError

    from workers.kafka_io.admin import delete_topics
    from workers.serving.errors import is_transient
    from workers.serving.streaming.sender import RelayLink, RelayProducer

    prefix = f"relayres{uuid.uuid4().hex[:8]}"
    topic = f"{prefix}.results"
    with KafkaAdminClient(bootstrap_servers=settings.kafka) as admin:
        spec = {"num_partitions": 1, "replication_factor": 1, "configs": {"max.message.bytes": "2000"}}
        admin.create_topics({topic: spec}, wait_for_metadata=True)
    since = now_ms()
    link = RelayLink(settings.kafka_connection, "inferq-test-relay-results", f"{prefix}.tokens")
    results = RelayProducer(link)
    try:
        fits = results.send(topic, "job-1", b"x" * 1500, [("job_id", b"job-1")])
        too_large = results.send(topic, "job-2", b"x" * 5000)
        assert fits.settle(30) and fits.error is None
        assert too_large.settle(30) and isinstance(too_large.error, MessageSizeTooLargeError)
        relay = psutil.Process(link.relay.proc.pid)
        relay.suspend()  # it cannot answer: the next result is written to it and left unanswered
        lost = results.send(topic, "job-3", b"again")
        assert not lost.settle(0.5)
        relay.kill()
        relay.wait(10)
        assert lost.settle(30) and isinstance(lost.error, ConnectionError) and is_transient(lost.error)
        again = results.send(topic, "job-3", b"again")
        assert again.settle(30) and again.error is None
        assert link.relay.proc.pid != relay.pid
    finally:
        link.close(10)
    records = read_topic(settings, topic, since, lambda rs: len(rs) >= 2)
    assert [r.key for r in records][:1] == [b"job-1"] and b"job-3" in {r.key for r in records}
    delete_topics(settings.kafka_connection, prefix)


@pytest.mark.services
@pytest.mark.slow
def test_a_worker_whose_relay_is_killed_again_and_again_publishes_every_result_once(settings, tmp_path):
    """Results leave through the relay: stopped and killed three times while hundreds of short jobs finish,
    it is started again each time; every job ends once, with exactly one result (what the dead relay held is
    sent again, and one the broker took before it died is found by the lookup, not sent twice), and the
    worker rides it out."""
    from sqlalchemy import create_engine

    from tests.workers.worker_factories import (
        job_rows,
        results_by_job,
        start_worker,
        wait_group_members,
        wait_terminal,
    )
    from workers.client import JobClient

    dep = make_deployment(settings)
    worker = start_worker(dep, tmp_path, "w-relay")
    db = create_engine(dep.database_url)
    try:
        wait_group_members(dep, 1)
        since = now_ms()
        jobs = [
            {"job_id": f"rk-{dep.topic_prefix}-{i}", "prompt": f"job {i}", "max_tokens": 4}
            for i in range(600)
        ]
        with JobClient(dep) as client:
            ids = [s.job_id for s in client.submit_many(jobs)]
        wait_until(lambda: any(r["status"] == "succeeded" for r in job_rows(db, ids).values()), timeout_s=120)
        killed = set()
        for _ in range(3):  # each time the relay serving now: the one started after the last kill
            deadline = time.monotonic() + 60
            while not (relays := _relays(worker.proc.pid) - killed):
                assert time.monotonic() < deadline, "no relay started again"
                time.sleep(0.05)
            for relay in relays:  # stopped first, so what is written to it meanwhile is surely unsent
                killed.add(relay)
                relay.suspend()
            time.sleep(0.5)
            for relay in relays:
                relay.kill()
        rows = wait_terminal(db, ids, timeout_s=180)
        assert {r["status"] for r in rows.values()} == {"succeeded"}
        results = results_by_job(dep, since, len(ids), settle_s=3.0)
        assert {job_id: len(rs) for job_id, rs in results.items()} == dict.fromkeys(ids, 1)
        assert worker.proc.poll() is None
    finally:
        db.dispose()
        assert worker.stop() == 0, worker.output()[-3000:]


def _relays(worker_pid: int) -> set[psutil.Process]:
    """The worker's live relay processes (a killed one stays a zombie until the worker reaps it)."""
    found = set()
    for child in psutil.Process(worker_pid).children():
        try:
            if "workers.serving.streaming.relay" in " ".join(child.cmdline()):
                found.add(child)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return found
