"""The token-event relay: a child process of the worker that owns the Kafka producer for token events.

kafka-python is pure Python: batching, framing and acknowledging thousands of events a second held the
worker's GIL for about a second per ten seconds of generation, and the engine loop waited for it after
torch ops. In a process of its own that work runs beside the engine instead of between its kernels.

Protocol (pipes, both ways length-prefixed): the worker writes `event_frame(track, key, value, headers)`
to stdin; the relay answers on stdout for every tracked event (delivered, failed or dropped) and with a
count of the untracked events it dropped. It exits when stdin closes, after a bounded flush, or at once when
the worker is gone (a thread watches the parent pid); it ignores SIGINT and SIGTERM, which are the worker's
to act on.
Run by the worker as `python -m workers.serving.streaming.relay`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import BinaryIO

ENV_CONNECTION = "INFERQ_RELAY_CONNECTION"  # the worker's KafkaConnection, as JSON (never on argv)
SEND_PAUSE_S = 2.0  # after a send failed, drop events this long without trying
DROP_REPORT_S = 0.5
FLUSH_S = 5.0  # at exit, the longest wait for the broker to take what is buffered
DELIVERED, FAILED, DROPPED = 0, 1, 2

_LENGTH = struct.Struct(">I")
_EVENT = struct.Struct(">QHH")  # track id (0: untracked), key length, headers length
_HEADER = struct.Struct(">HH")  # one header's name length and value length
_REPLY = struct.Struct(">QBH")  # track id, outcome, message length

log = logging.getLogger("workers.serving.streaming.relay")


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def event_frame(track: int, key: bytes, value: bytes, headers: Sequence[tuple[str, bytes]] = ()) -> bytes:
    packed = b"".join(_HEADER.pack(len(n), len(v)) + n + v for n, v in ((n.encode(), v) for n, v in headers))
    return frame(_EVENT.pack(track, len(key), len(packed)) + key + packed + value)


def _unpack_headers(data: bytes) -> list[tuple[str, bytes]]:
    headers, at = [], 0
    while at < len(data):
        name_len, value_len = _HEADER.unpack_from(data, at)
        at += _HEADER.size
        headers.append((data[at : at + name_len].decode(), data[at + name_len : at + name_len + value_len]))
        at += name_len + value_len
    return headers


def reply_frame(track: int, outcome: int, message: str = "") -> bytes:
    text = message.encode()[:1000]
    return frame(_REPLY.pack(track, outcome, len(text)) + text)


def read_frames(stream: BinaryIO) -> Iterator[bytes]:
    """Payloads until the stream ends (a frame cut short by a dead writer ends it too)."""
    while True:
        head = stream.read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            return
        (size,) = _LENGTH.unpack(head)
        payload = stream.read(size)
        if len(payload) < size:
            return
        yield payload


def parse_event(payload: bytes) -> tuple[int, bytes, bytes, list[tuple[str, bytes]]]:
    """(track, key, value, headers) of an event frame's payload."""
    track, key_len, headers_len = _EVENT.unpack_from(payload)
    key_end = _EVENT.size + key_len
    end = key_end + headers_len
    return track, payload[_EVENT.size : key_end], payload[end:], _unpack_headers(payload[key_end:end])


def parse_reply(payload: bytes) -> tuple[int, int, str]:
    track, outcome, size = _REPLY.unpack_from(payload)
    return track, outcome, payload[_REPLY.size : _REPLY.size + size].decode(errors="replace")


def connection_json(conn) -> str:
    from dataclasses import asdict

    return json.dumps(asdict(conn))


def _connection(text: str):
    from workers.settings import KafkaConnection, KafkaSecurity

    doc = json.loads(text)
    return KafkaConnection(doc["bootstrap"], KafkaSecurity(**doc["security"]), doc.get("compression", "none"))


class _Replies:
    """Answers to the worker, from the main thread and the producer's I/O thread alike."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._lock = threading.Lock()

    def send(self, track: int, outcome: int, message: str = "") -> None:
        with self._lock:
            try:
                self._out.write(reply_frame(track, outcome, message))
                self._out.flush()
            except (BrokenPipeError, ValueError):  # the worker is gone: nobody to answer
                pass


class _Drops:
    """Untracked events dropped: answered as one count at most every DROP_REPORT_S (an outage drops
    thousands a second, and one answer each would cost the worker what this process saves it)."""

    def __init__(self, replies: _Replies) -> None:
        self._replies = replies
        self._count = 0
        self._reported = 0.0

    def add(self, track: int, why: str) -> None:
        if track:
            self._replies.send(track, DROPPED, why)
            return
        self._count += 1
        if time.monotonic() - self._reported >= DROP_REPORT_S:
            self.report()

    def report(self) -> None:
        if self._count:
            self._replies.send(0, DROPPED, str(self._count))
            self._count = 0
        self._reported = time.monotonic()


TENANT_SLOT = "{tenant}"


def topic_of(topic: str, headers: Sequence[tuple[str, bytes]]) -> str:
    """The event's topic: with per-tenant topics (`topic` holds TENANT_SLOT) its tenant's, named by its
    `tenant` header (the worker sets it from the job's proven tenant)."""
    if TENANT_SLOT not in topic:
        return topic
    tenant = next((v for k, v in headers if k == "tenant"), b"").decode()
    return topic.replace(TENANT_SLOT, tenant)


def relay(topic: str, client_id: str, conn, source: BinaryIO, replies: _Replies) -> None:
    from workers.kafka_io import Producer
    from workers.serving.errors import describe_error, until_available

    where = f"Kafka at {conn.bootstrap}"
    producer = until_available(lambda: Producer(conn, client_id, max_block_s=0.5), where)
    drops = _Drops(replies)
    paused_until: dict[str, float] = {}  # by topic: one tenant's missing topic pauses no other's events
    for payload in read_frames(source):
        track, key, value, headers = parse_event(payload)
        target = topic_of(topic, headers)
        if time.monotonic() < paused_until.get(target, 0.0):
            drops.add(track, "the broker was away a moment ago")
            continue
        try:
            delivery = producer.send(target, key, value, headers)
        except Exception as exc:  # noqa: BLE001 - buffer full or no metadata: drop, keep the rest going
            paused_until[target] = time.monotonic() + SEND_PAUSE_S
            why = describe_error(exc)
            log.warning("token events to %s are being dropped for %.0fs: %s", target, SEND_PAUSE_S, why)
            drops.add(track, why)
            continue
        if track:
            delivery.on_settled(
                lambda error, t=track: replies.send(
                    t, FAILED if error else DELIVERED, describe_error(error) if error else ""
                )
            )
    drops.report()
    try:
        producer.flush(FLUSH_S)
    except Exception as exc:  # noqa: BLE001 - the broker is away: what is still buffered is lost
        log.warning("token events not flushed at exit: %s", describe_error(exc))
    producer.close(1.0)


def _exit_with_parent() -> None:
    """Leave when the worker is gone, even while waiting for the broker (not reading stdin, this process
    would not see the pipe close): a thread watches for the worker's pid to stop being the parent."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> int:
    from workers import logs

    topic, client_id, worker_id, level, log_format = sys.argv[1:6]
    logs.configure(level, log_format, worker_id)
    _exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = _connection(os.environ.pop(ENV_CONNECTION))
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")  # the protocol's own handle on stdout ...
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # ... and a stray print cannot corrupt it
    relay(topic, client_id, conn, sys.stdin.buffer, _Replies(replies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
