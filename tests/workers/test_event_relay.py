"""The token-event relay process: its framing, and events through it to the real broker, across its death."""

from __future__ import annotations

import io
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from schemas.jobs import TokenEvent
from tests.workers.worker_factories import make_deployment, now_ms, read_topic, token_events, wait_until
from workers.serving.streaming import relay as event_relay
from workers.serving.streaming.sender import TokenEventSender, relay_environment
from workers.settings import KafkaConnection


def test_frames_round_trip_and_a_frame_cut_short_ends_the_stream():
    headers = [("job_id", b"job-1"), ("tenant", "accént".encode()), ("empty", b"")]
    stream = event_relay.event_frame(7, b"job-1", b'{"x": 1}', headers)
    stream += event_relay.event_frame(0, b"job-3", b"{}") + event_relay.reply_frame(7, 1, "broker away")
    cut = event_relay.event_frame(0, b"job-2", b"{}")[:-1]
    payloads = list(event_relay.read_frames(io.BytesIO(stream + cut)))
    assert len(payloads) == 3
    assert event_relay.parse_event(payloads[0]) == (7, b"job-1", b'{"x": 1}', headers)
    assert event_relay.parse_event(payloads[1]) == (0, b"job-3", b"{}", [])
    assert event_relay.parse_reply(payloads[2]) == (7, 1, "broker away")


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
        # events sent into the dead relay are dropped (counted) until a new relay takes over
        wait_until(lambda: _confirmed(sender.send(_event(f"{job}-b", 0), track=True)), timeout_s=60)
        assert drops
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
