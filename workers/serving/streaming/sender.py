"""Token events handed to the relay process (workers/serving/streaming/relay.py), which sends them to Kafka.

The engine loop only queues an event. A writer thread encodes queued events and writes them to the relay's
stdin in one write per burst (the write releases the GIL); a reader thread settles the handles of tracked
events (the last of an attempt) from the relay's answers. Per job, events leave in the order they were
made. Events are dropped rather than stalling anything (the final result never depends on them): while
the broker is away, while more than `max_queued` wait, and when the relay dies (it is started again).
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
from collections.abc import Callable, Mapping

from schemas.jobs import TokenEvent
from workers.serving.errors import Backoff, describe_error
from workers.serving.headers import job_headers
from workers.serving.streaming import relay as token_relay
from workers.serving.streaming.relay import DELIVERED, DROPPED, ENV_CONNECTION
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
    """Handle of one queued event: `wait` returns once the broker has it (or raises).

    A held lock, released when settled: one is made for every job's last event, and a lock costs the
    engine thread a tenth of what a threading.Event (a Condition, its lock and deque) does."""

    __slots__ = ("_pending", "_error")

    def __init__(self) -> None:
        self._pending = threading.Lock()
        self._pending.acquire()
        self._error: BaseException | None = None

    def _settle(self, error: BaseException | None = None) -> None:
        if not self._pending.locked():  # settled already: the first outcome stands
            return
        self._error = error
        self._pending.release()

    def wait(self, timeout_s: float = 30.0) -> None:
        if not self._pending.acquire(timeout=timeout_s):
            raise TimeoutError("the token event was not confirmed in time")
        self._pending.release()  # settled for good: every later wait returns at once
        if self._error is not None:
            raise self._error


class _Relay:
    """One relay process, and the tracked events it has not answered yet."""

    def __init__(self, argv: list[str], env: dict[str, str], on_drop: Callable[[int], None]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.tracked: dict[int, Sent] = {}
        self.lock = threading.Lock()
        self.dead = False  # set once the relay's answers have ended: nothing tracked will be answered
        self.started = time.monotonic()
        self._on_drop = on_drop
        self._reader = threading.Thread(target=self._read, name="inferq-relay-replies", daemon=True)
        self._reader.start()

    def track(self, track: int, sent: Sent) -> None:
        with self.lock:
            if not self.dead:
                self.tracked[track] = sent
                return
        sent._settle(ConnectionError("token event: the relay process exited"))

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
            log.exception("token-event relay: unreadable answer")
        with self.lock:  # the relay exited: nothing it still had will be answered
            self.dead = True
            orphans, self.tracked = list(self.tracked.values()), {}
        if orphans:
            self._on_drop(len(orphans))
        for sent in orphans:
            sent._settle(ConnectionError("token event: the relay process exited"))

    def _answer(self, track: int, outcome: int, message: str) -> None:
        if outcome == DROPPED:
            self._on_drop(1 if track else int(message or 1))  # untracked drops come as one count
        with self.lock:
            sent = self.tracked.pop(track, None) if track else None
        if sent is not None:
            sent._settle(None if outcome == DELIVERED else ConnectionError(f"token event: {message}"))


class TokenEventSender:
    def __init__(
        self,
        conn: KafkaConnection,
        client_id: str,
        topic: str,
        on_drop: Callable[[int], None] = lambda n: None,  # events dropped (e.g. a metric's `inc`)
        log_config: tuple[str, str, str] = ("worker", "INFO", "text"),  # worker_id, level, format
        max_queued: int = MAX_QUEUED,
    ) -> None:
        self._argv = [sys.executable, "-m", "workers.serving.streaming.relay", topic, client_id, *log_config]
        self._env = relay_environment(conn)
        self._on_drop = on_drop
        self._max_queued = max_queued
        # a SimpleQueue: its put (once per event, on the engine thread) is a C call, no Condition to notify
        self._queue: queue.SimpleQueue[tuple[TokenEvent, str, Sent | None] | None] = queue.SimpleQueue()
        self._tracks = itertools.count(1)
        self._relay = _Relay(self._argv, self._env, self._on_drop)
        self._restart = Backoff(base_s=0.5, cap_s=30.0)
        self._thread = threading.Thread(target=self._run, name="inferq-token-events", daemon=True)
        self._thread.start()

    def send(self, event: TokenEvent, tenant: str = "default", track: bool = False) -> Sent | None:
        """Queue an event of `tenant`'s job; with `track`, a handle to wait for its delivery (the last event
        of an attempt)."""
        sent = Sent() if track else None
        if self._queue.qsize() >= self._max_queued:
            self._drop(sent, "too many token events waiting for the relay")
        else:
            self._queue.put((event, tenant, sent))
        return sent

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop the relay (it flushes to the broker first)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._relay.close(timeout_s, writer_stuck=self._thread.is_alive())

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
        relay, frames = self._relay, []
        for event, tenant, sent in items:
            try:
                value = event.model_dump_json().encode()
            except Exception as exc:  # noqa: BLE001 - one event that cannot be encoded is dropped alone
                self._drop(sent, describe_error(exc))
                continue
            track = 0
            if sent is not None:
                track = next(self._tracks)
                relay.track(track, sent)
            headers = job_headers(event.job_id, event.attempt, tenant)
            frames.append(token_relay.event_frame(track, event.job_id.encode(), value, headers))
        try:
            relay.write(b"".join(frames))
        except (OSError, ValueError) as exc:  # the relay died: its events are lost, start a new one
            if time.monotonic() - relay.started > RELAY_STABLE_S:
                self._restart.reset()  # it had run a good while: this is no crash loop
            delay = self._restart.next_delay()
            log.error("the token-event relay exited (%s); starting it again in %.1fs", exc, delay)
            self._on_drop(sum(1 for _, _, sent in items if sent is None))  # tracked ones: swept by close
            relay.close(1.0)
            time.sleep(delay)
            try:
                self._relay = _Relay(self._argv, self._env, self._on_drop)
            except OSError as again:  # keep the dead one: the next write fails and tries again
                log.error("the token-event relay could not start: %s", again)

    def _drop(self, sent: Sent | None, why: str) -> None:
        self._on_drop(1)
        if sent is not None:
            sent._settle(ConnectionError(f"token event dropped: {why}"))
