"""Token events serialized and handed to the producer on a thread of their own.

A kafka-python `send` costs ~0.1 ms of Python per message; thousands of events a second on the engine loop
were ~3 % of its time. The loop only queues the event; this thread encodes and sends it, in queue order
(per job, events leave in the order they were made). While the broker is away, events are dropped rather
than stalling anything: the final result never depends on them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from schemas.jobs import TokenEvent
from workers.kafka_io import Delivery, Producer

log = logging.getLogger(__name__)

SEND_PAUSE_S = 2.0  # after a send failed, drop events this long without trying


class Sent:
    """Handle of one queued event: `wait` returns once the broker has it (or raises)."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._delivery: Delivery | None = None
        self._error: BaseException | None = None

    def _settle(self, delivery: Delivery | None, error: BaseException | None = None) -> None:
        self._delivery, self._error = delivery, error
        self._ready.set()

    def wait(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        if not self._ready.wait(timeout_s):
            raise TimeoutError("the token event was not sent in time")
        if self._error is not None:
            raise self._error
        if self._delivery is not None:
            self._delivery.wait(max(0.0, deadline - time.monotonic()))


class TokenEventSender:
    def __init__(self, producer: Producer, topic: str, on_drop: Callable[[], None] = lambda: None) -> None:
        self._producer = producer
        self._topic = topic
        self._on_drop = on_drop
        self._queue: queue.Queue[tuple[TokenEvent, Sent | None] | None] = queue.Queue()
        self._paused_until = 0.0
        self._thread = threading.Thread(target=self._run, name="inferq-token-events", daemon=True)
        self._thread.start()

    def send(self, event: TokenEvent, track: bool = False) -> Sent | None:
        """Queue an event; with `track`, a handle to wait for its delivery (the last event of an attempt)."""
        sent = Sent() if track else None
        self._queue.put((event, sent))
        return sent

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, sent = item
            if time.monotonic() < self._paused_until:
                self._drop(sent, "the broker was away a moment ago")
                continue
            try:
                delivery = self._producer.send(self._topic, event.job_id, event.model_dump_json().encode())
            except Exception as exc:  # noqa: BLE001 - buffer full or no metadata: drop, keep the rest going
                self._paused_until = time.monotonic() + SEND_PAUSE_S
                log.warning("token events are being dropped for %.0fs: %s", SEND_PAUSE_S, exc)
                self._drop(sent, str(exc))
                continue
            if sent is not None:
                sent._settle(delivery)

    def _drop(self, sent: Sent | None, why: str) -> None:
        self._on_drop()
        if sent is not None:
            sent._settle(None, ConnectionError(f"token event dropped: {why}"))
