"""The Kafka relay: a child process of the worker that owns the Kafka producer for token events and results.

kafka-python is pure Python: batching, framing and acknowledging thousands of messages a second held the
worker's GIL (a send is about 27 us of it, and its I/O thread as much again), time the engine loop waited
for. In a process of its own that work runs beside the worker instead of between its steps.

Protocol (pipes, both ways length-prefixed): the worker writes `message_frame(...)` to stdin; the relay
answers on stdout for every tracked message (delivered, failed or dropped) and with a count of the
untracked token events it dropped. Token events may be dropped (while the broker is away, their topic is
paused); a durable message (a result) never is: the broker's answer comes back, a failure with its error's
class, and the worker decides (the persister's outbox retries). It exits when stdin closes, after a bounded
flush, or at once when the worker is gone (a thread watches the parent pid); it ignores SIGINT and SIGTERM,
which are the worker's to act on.
Run by the worker as `python -m workers.serving.streaming.relay TOPIC CLIENT_ID WORKER_ID LEVEL FORMAT
[NICENESS]` (NICENESS: see `_yield_cpu`).
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
from dataclasses import dataclass
from typing import BinaryIO

ENV_CONNECTION = "INFERQ_RELAY_CONNECTION"  # the worker's KafkaConnection, as JSON (never on argv)
SEND_PAUSE_S = 2.0  # after a send failed, drop events this long without trying
# a topic's first send waits this long for its metadata: a busy broker (or a topic it is creating) may take
# longer than a send's block, and its events would be dropped as if the broker were away
FIRST_METADATA_S = 5.0
DROP_REPORT_S = 0.5
FLUSH_S = 5.0  # at exit, the longest wait for the broker to take what is buffered
DELIVERED, FAILED, DROPPED = 0, 1, 2

_LENGTH = struct.Struct(">I")
_MESSAGE = struct.Struct(">QBHHH")  # track id (0: untracked), durable, topic, key and headers lengths
_HEADER = struct.Struct(">HH")  # one header's name length and value length
_REPLY = struct.Struct(">QBH")  # track id, outcome, message length

log = logging.getLogger("workers.serving.streaming.relay")


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


@dataclass(frozen=True)
class Message:
    track: int  # 0: untracked (no answer unless dropped, and then only as a count)
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    topic: str = ""  # "": the relay's token-event topic (its tenant's, with per-tenant topics)
    durable: bool = False  # never dropped: the broker's answer, whatever it is, goes back


def message_frame(
    track: int,
    key: bytes,
    value: bytes,
    headers: Sequence[tuple[str, bytes]] = (),
    topic: str = "",
    durable: bool = False,
) -> bytes:
    packed = b"".join(_HEADER.pack(len(n), len(v)) + n + v for n, v in ((n.encode(), v) for n, v in headers))
    name = topic.encode()
    head = _MESSAGE.pack(track, durable, len(name), len(key), len(packed))
    return frame(head + name + key + packed + value)


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


def parse_message(payload: bytes) -> Message:
    track, durable, topic_len, key_len, headers_len = _MESSAGE.unpack_from(payload)
    key_at = _MESSAGE.size + topic_len
    headers_at = key_at + key_len
    end = headers_at + headers_len
    topic = payload[_MESSAGE.size : key_at].decode()
    headers = _unpack_headers(payload[headers_at:end])
    return Message(track, payload[key_at:headers_at], payload[end:], headers, topic, bool(durable))


def parse_reply(payload: bytes) -> tuple[int, int, str]:
    track, outcome, size = _REPLY.unpack_from(payload)
    return track, outcome, payload[_REPLY.size : _REPLY.size + size].decode(errors="replace")


def error_text(exc: BaseException) -> str:
    """A failure as answered: its class's name (the worker rebuilds the error from it), then why."""
    from workers.serving.errors import describe_error

    return f"{type(exc).__name__}\n{describe_error(exc)}"


def error_of(text: str) -> BaseException:
    """The error a failure's answer names, rebuilt (see kafka_io.errors.error_named)."""
    from workers.kafka_io.errors import error_named

    name, _, why = text.partition("\n")
    return error_named(name, why)


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

    def answer(self, track: int, error: BaseException | None) -> None:
        """The broker's outcome for a tracked message."""
        self.send(track, FAILED if error else DELIVERED, error_text(error) if error else "")

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
    seen: set[str] = set()  # topics sent to: their metadata was waited for (once, even if it never came)
    for payload in read_frames(source):
        message = parse_message(payload)
        track, target = message.track, message.topic or topic_of(topic, message.headers)
        if target not in seen:
            seen.add(target)
            try:
                if not producer.await_topic(target, FIRST_METADATA_S):
                    log.warning("no metadata for %s after %.0fs", target, FIRST_METADATA_S)
            except Exception as exc:  # noqa: BLE001 - e.g. not authorized: the send below is answered with it
                log.warning("no metadata for %s: %s", target, describe_error(exc))
        if not message.durable and time.monotonic() < paused_until.get(target, 0.0):
            drops.add(track, "the broker was away a moment ago")
            continue
        try:
            # a result's size is checked: one too large for its topic must not turn the client fatal
            delivery = producer.send(target, message.key, message.value, message.headers, message.durable)
        except Exception as exc:  # noqa: BLE001 - buffer full, no metadata, too large: answered, never fatal
            if message.durable:  # the worker's outbox decides when to try again
                replies.send(track, FAILED, error_text(exc))
                continue
            paused_until[target] = time.monotonic() + SEND_PAUSE_S
            why = describe_error(exc)
            log.warning("token events to %s are being dropped for %.0fs: %s", target, SEND_PAUSE_S, why)
            drops.add(track, why)
            continue
        if track:
            delivery.on_settled(lambda error, t=track: replies.answer(t, error))
    drops.report()
    try:
        producer.flush(FLUSH_S)
    except Exception as exc:  # noqa: BLE001 - the broker is away: what is still buffered is lost (unanswered)
        log.warning("relay: messages not flushed at exit: %s", describe_error(exc))
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


def _yield_cpu(niceness: int) -> None:
    """Run at a lower CPU priority than the worker (`niceness` added to its nice value): where cores are
    short, the engine loop, which keeps the model fed, gets one first, and this process catches up in the
    cores' idle moments (its messages go out a little later, in larger batches). Where cores are free it
    changes nothing. Lowering one's own priority needs no privilege."""
    if niceness > 0:
        try:
            os.nice(niceness)
        except OSError as exc:
            log.warning("relay: could not lower its CPU priority: %s", exc)


def main() -> int:
    from workers import logs

    topic, client_id, worker_id, level, log_format = sys.argv[1:6]
    logs.configure(level, log_format, worker_id)
    _exit_with_parent()
    _yield_cpu(int(sys.argv[6]) if len(sys.argv) > 6 else 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = _connection(os.environ.pop(ENV_CONNECTION))
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")  # the protocol's own handle on stdout ...
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # ... and a stray print cannot corrupt it
    relay(topic, client_id, conn, sys.stdin.buffer, _Replies(replies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
