"""Messages handed to the relay process (workers/serving/streaming/relay.py), which sends them to Kafka.

Token events: the engine loop only queues one. A writer thread encodes queued events and writes them to the
relay's stdin in one write per burst (the write releases the GIL). Per job, events leave in the order they
were made. Events are dropped rather than stalling anything (the final result never depends on them):
while the broker is away, while more than `max_queued` wait, and when the relay is down (it is started
again). Results (`RelayProducer`): sent as durable messages, answered with the broker's outcome.
A reader thread settles the handles of tracked messages from the relay's answers.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from schemas.jobs import TokenEvent
from workers.serving.errors import Backoff, describe_error
from workers.serving.headers import job_headers
from workers.serving.streaming import relay as token_relay
from workers.serving.streaming.relay import DELIVERED, DROPPED, ENV_CONNECTION, error_of
from workers.settings import KafkaConnection

log = logging.getLogger(__name__)

# The environment the relay starts with: what runs Python and opens TLS connections, nothing of the
# worker's own (INFERQ_DATABASE_URL holds the database password; a deployment may set other credentials).
# Its Kafka connection, SASL password included, comes apart in ENV_CONNECTION.
RELAY_ENV = ("PATH", "HOME", "LANG", "TZ", "TMPDIR", "LD_LIBRARY_PATH", "SSL_CERT_FILE", "SSL_CERT_DIR")
RELAY_ENV_PREFIXES = ("LC_", "PYTHON")  # the locale; PYTHONPATH, PYTHONHASHSEED, PYTHONUTF8, ...
MAX_QUEUED = 20_000  # events waiting for the relay; past this, new ones are dropped (a stuck relay)
RELAY_STABLE_S = 60.0  # a relay that ran this long before dying restarts without the backoff built up


def relay_environment(conn: KafkaConnection, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    kept = {k: v for k, v in env.items() if k in RELAY_ENV or k.startswith(RELAY_ENV_PREFIXES)}
    return {**kept, ENV_CONNECTION: token_relay.connection_json(conn)}


class Sent:
    """Handle of one message on its way through the relay: `wait` returns once the broker has it (or
    raises); `settle` and `error` serve a caller that retries (kafka_io.Delivery's interface).

    A held lock, released when settled: one is made for every job's last event, and a lock costs the
    engine thread a tenth of what a threading.Event (a Condition, its lock and deque) does."""

    __slots__ = ("_pending", "_error", "_flush")

    def __init__(self, flush: Callable[[], None] | None = None) -> None:
        self._pending = threading.Lock()
        self._pending.acquire()
        self._error: BaseException | None = None
        self._flush = flush  # writes what its sender holds back, before anyone waits for it

    def _settle(self, error: BaseException | None = None) -> None:
        if not self._pending.locked():  # settled already: the first outcome stands
            return
        self._error = error
        self._pending.release()

    def settle(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for the outcome; True once settled (see `error`)."""
        if self._flush is not None:
            self._flush()
        if not self._pending.acquire(timeout=timeout_s):
            return False
        self._pending.release()  # settled for good: every later wait returns at once
        return True

    @property
    def error(self) -> BaseException | None:
        return self._error

    def wait(self, timeout_s: float = 30.0) -> None:
        if not self.settle(timeout_s):
            raise TimeoutError("the message was not confirmed in time")
        if self._error is not None:
            raise self._error


class _Relay:
    """One relay process, and the tracked messages it has not answered yet."""

    def __init__(self, argv: list[str], env: dict[str, str], on_drop: Callable[[int], None]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.tracked: dict[int, tuple[Sent, bool]] = {}  # track id -> (handle, whether a token event)
        self.lock = threading.Lock()
        self.dead = False  # set once the relay's answers have ended: nothing tracked will be answered
        self.started = time.monotonic()
        self._on_drop = on_drop
        self._reader = threading.Thread(target=self._read, name="inferq-relay-replies", daemon=True)
        self._reader.start()

    def track(self, track: int, sent: Sent, event: bool) -> None:
        with self.lock:
            if not self.dead:
                self.tracked[track] = (sent, event)
                return
        sent._settle(ConnectionError("the relay process exited"))

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def close(self, timeout_s: float, writer_stuck: bool = False) -> None:
        """Let the relay flush and exit; kill it past `timeout_s`. With `writer_stuck` (a write into its
        full pipe never returned), kill it first: closing the pipe would wait for that write forever."""
        if writer_stuck:
            self.proc.kill()
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the relay flushes what it has, then exits
            self.proc.wait(timeout_s)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
        self._reader.join(timeout_s)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for payload in token_relay.read_frames(self.proc.stdout):
                self._answer(*token_relay.parse_reply(payload))
        except Exception:  # noqa: BLE001 - a garbled answer ends this relay's answers, not the worker
            log.exception("relay: unreadable answer")
        with self.lock:  # the relay exited: nothing it still had will be answered
            self.dead = True
            orphans, self.tracked = list(self.tracked.values()), {}
        events = sum(1 for _, event in orphans if event)
        if events:
            self._on_drop(events)
        for sent, _ in orphans:
            sent._settle(ConnectionError("the relay process exited"))

    def _answer(self, track: int, outcome: int, message: str) -> None:
        if outcome == DROPPED:
            self._on_drop(1 if track else int(message or 1))  # untracked drops come as one count
        with self.lock:
            sent, _ = self.tracked.pop(track, (None, False)) if track else (None, False)
        if sent is None:
            return
        if outcome == DELIVERED:
            sent._settle(None)
        elif outcome == DROPPED:
            sent._settle(ConnectionError(f"token event dropped: {message}"))
        else:
            sent._settle(error_of(message))


class RelayLink:
    """The relay process that token events and results share, written by one thread at a time (frames
    never interleave). A relay that died is started again at the first write its backoff allows; until
    then writes fail at once (ConnectionError), so no caller ever sleeps here."""

    def __init__(
        self,
        conn: KafkaConnection,
        client_id: str,
        topic: str,
        on_drop: Callable[[int], None] = lambda n: None,  # token events dropped (e.g. a metric's `inc`)
        log_config: tuple[str, str, str] = ("worker", "INFO", "text"),  # worker_id, level, format
        niceness: int = 0,  # added to the relay's nice value: its CPU priority below the worker's
    ) -> None:
        module = "workers.serving.streaming.relay"
        self._argv = [sys.executable, "-m", module, topic, client_id, *log_config, str(niceness)]
        self._env = relay_environment(conn)
        self._on_drop = on_drop
        self._tracks = itertools.count(1)
        self._lock = threading.Lock()
        self._relay = _Relay(self._argv, self._env, on_drop)
        self._restart = Backoff(base_s=0.5, cap_s=30.0)
        self._down_until = 0.0  # a relay that died is started again from then

    @property
    def relay(self) -> _Relay:
        return self._relay

    def next_track(self) -> int:
        return next(self._tracks)

    def write(self, data: bytes, tracked: Sequence[tuple[int, Sent, bool]] = ()) -> None:
        """Write frames; `tracked`: (track id, handle, whether a token event) of those to be answered.
        Raises ConnectionError when the relay is down (its tracked handles are settled so)."""
        with self._lock:
            relay = self._relay
            if relay.dead or relay.proc.poll() is not None:
                try:
                    relay = self._start_again()
                except ConnectionError as exc:
                    self._lost(tracked, exc)
                    raise
            for track, sent, event in tracked:
                relay.track(track, sent, event)
            try:
                relay.write(data)
            except (OSError, ValueError) as exc:  # the relay died: what it had is answered as lost
                if time.monotonic() - relay.started > RELAY_STABLE_S:
                    self._restart.reset()  # it had run a good while: this is no crash loop
                self._down_until = time.monotonic() + self._restart.next_delay()
                log.error("the relay process exited (%s); starting it again in %.1fs", exc,
                          self._down_until - time.monotonic())  # fmt: skip
                relay.close(1.0)
                raise ConnectionError(f"the relay process exited: {exc}") from exc

    def _lost(self, tracked: Sequence[tuple[int, Sent, bool]], exc: ConnectionError) -> None:
        events = sum(1 for _, _, event in tracked if event)
        if events:
            self._on_drop(events)
        for _, sent, _ in tracked:
            sent._settle(exc)

    def _start_again(self) -> _Relay:
        if time.monotonic() < self._down_until:
            raise ConnectionError("the relay process is down")
        self._relay.close(1.0)  # its tracked messages are answered as lost
        try:
            self._relay = _Relay(self._argv, self._env, self._on_drop)
        except OSError as exc:  # keep the dead one: the next write tries again
            self._down_until = time.monotonic() + self._restart.next_delay()
            raise ConnectionError(f"the relay process could not start: {exc}") from exc
        return self._relay

    def close(self, timeout_s: float, writer_stuck: bool = False) -> None:
        self._relay.close(timeout_s, writer_stuck)


class RelayProducer:
    """Durable messages (results) through the relay: kafka_io.Producer's `send`, without the client's work
    in this process. Sends are held back until someone waits for one of them (or `flush`), so a round of
    sends is one pipe write; the relay answers each with the broker's outcome (its error rebuilt here)."""

    def __init__(self, link: RelayLink) -> None:
        self._link = link
        self._lock = threading.Lock()
        self._held: list[tuple[bytes, int, Sent]] = []

    def send(
        self, topic: str, key: str | bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]] = ()
    ) -> Sent:
        raw_key = key.encode() if isinstance(key, str) else (key or b"")
        sent = Sent(self.flush)
        track = self._link.next_track()
        frame = token_relay.message_frame(track, raw_key, value, headers, topic=topic, durable=True)
        with self._lock:
            self._held.append((frame, track, sent))
        return sent

    def flush(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        if not held:
            return
        try:
            tracked = [(track, sent, False) for _, track, sent in held]
            self._link.write(b"".join(frame for frame, _, _ in held), tracked)
        except ConnectionError as exc:  # the relay is down: these failed (transiently), the caller retries
            for _, _, sent in held:
                sent._settle(exc)


class TokenEventSender:
    def __init__(
        self,
        conn: KafkaConnection,
        client_id: str,
        topic: str,
        on_drop: Callable[[int], None] = lambda n: None,  # events dropped (e.g. a metric's `inc`)
        log_config: tuple[str, str, str] = ("worker", "INFO", "text"),  # worker_id, level, format
        max_queued: int = MAX_QUEUED,
        niceness: int = 0,  # the relay's CPU priority below the worker's (see relay._yield_cpu)
    ) -> None:
        self.link = RelayLink(conn, client_id, topic, on_drop, log_config, niceness)  # results share it
        self._on_drop = on_drop
        self._max_queued = max_queued
        # a SimpleQueue: its put (once per event, on the engine thread) is a C call, no Condition to notify
        self._queue: queue.SimpleQueue[tuple[TokenEvent, str, Sent | None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="inferq-token-events", daemon=True)
        self._thread.start()

    @property
    def _relay(self) -> _Relay:
        return self.link.relay

    def send(self, event: TokenEvent, tenant: str = "default", track: bool = False) -> Sent | None:
        """Queue an event of `tenant`'s job; with `track`, a handle to wait for its delivery (the last event
        of an attempt)."""
        sent = Sent() if track else None
        if self._queue.qsize() >= self._max_queued:
            self._drop(sent, "too many token events waiting for the relay")
        else:
            self._queue.put((event, tenant, sent))
        return sent

    def stop(self, timeout_s: float = 10.0) -> None:
        """Hand what is queued to the relay and stop taking events; the relay goes on (results use it)."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop the relay (it flushes to the broker first)."""
        if self._thread.is_alive():
            self.stop(timeout_s)
        self.link.close(timeout_s, writer_stuck=self._thread.is_alive())

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            while len(items) < 512:  # one write for a burst
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in items
            try:
                self._write([item for item in items if item is not None])
            except Exception:  # noqa: BLE001 - this thread must outlive any one bad event
                log.exception("token events: a burst could not be sent")
            if stop:
                return

    def _write(self, items: list[tuple[TokenEvent, str, Sent | None]]) -> None:
        frames, tracked = [], []
        for event, tenant, sent in items:
            try:
                value = event.model_dump_json().encode()
            except Exception as exc:  # noqa: BLE001 - one event that cannot be encoded is dropped alone
                self._drop(sent, describe_error(exc))
                continue
            track = 0
            if sent is not None:
                track = self.link.next_track()
                tracked.append((track, sent, True))
            headers = job_headers(event.job_id, event.attempt, tenant)
            frames.append(token_relay.message_frame(track, event.job_id.encode(), value, headers))
        if not frames:
            return
        try:
            self.link.write(b"".join(frames), tracked)
        except ConnectionError:  # the relay is down: these events are lost (tracked ones are answered so)
            self._on_drop(len(frames) - len(tracked))

    def _drop(self, sent: Sent | None, why: str) -> None:
        self._on_drop(1)
        if sent is not None:
            sent._settle(ConnectionError(f"token event dropped: {why}"))
