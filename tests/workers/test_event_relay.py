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
from workers.serving import token_relay as event_relay
from workers.serving.token_sender import TokenEventSender


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
        "from workers.serving.token_sender import TokenEventSender\n"
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
