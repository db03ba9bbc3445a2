"""Writes job rows on a background thread, then publishes results and hands back offsets to ack.

The engine loop must not wait for Postgres between steps. Order is kept per worker: a batch is one
transaction; only after it commits are its results published (a result never precedes its row) and
its source offsets released for committing (an offset never passes an unwritten job).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeVar

from sqlalchemy import Connection, Engine

from schemas.jobs import JobResult
from workers.inflight import utcnow
from workers.kafka_io import Delivery
from workers.store import Terminal, finish, mark_running

log = logging.getLogger(__name__)

Source = tuple[str, int, int]  # topic, partition, offset
T = TypeVar("T")


@dataclass
class WriteBatch:
    running: list[tuple[str, datetime]] = field(default_factory=list)
    terminal: list[tuple[Terminal, JobResult, list[Source]]] = field(default_factory=list)
    # extra work in the same transaction: returns results to publish (e.g. rejections, pre-cancels)
    custom: list[tuple[Callable[[Connection], list[JobResult]], list[Source]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.running or self.terminal or self.custom)


class Persister:
    def __init__(
        self,
        engine: Engine,
        publish: Callable[[JobResult], Delivery],
        retry_s: float = 1.0,
    ) -> None:
        self._engine = engine
        self._publish = publish
        self._retry_s = retry_s
        self._inbox: queue.Queue[WriteBatch | None] = queue.Queue()
        self._done: queue.Queue[Source] = queue.Queue()  # offsets safe to ack, read by the loop
        self._thread = threading.Thread(target=self._run, name="inferq-persister", daemon=True)
        self.written_terminal = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, batch: WriteBatch) -> None:
        if batch:
            self._inbox.put(batch)

    def backlog(self) -> int:
        return self._inbox.qsize()

    def acked(self) -> list[Source]:
        out: list[Source] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout_s: float = 30.0) -> None:
        """Write everything submitted so far, then stop."""
        self._inbox.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            batch = self._inbox.get()
            if batch is None:
                return
            # merge what queued up meanwhile into one transaction: fewer round trips under load
            stop = False
            while not stop:
                try:
                    more = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                else:
                    batch.running += more.running
                    batch.terminal += more.terminal
                    batch.custom += more.custom
            self._write_until_done(batch)
            if stop:
                return

    def _write_until_done(self, batch: WriteBatch) -> None:
        # Postgres or Kafka down: keep the batch and retry; offsets stay uncommitted, so nothing is lost.
        results = self._retry("writing job rows", lambda: self._write(batch))
        # A committed offset must never outrun its result message. Waiting for these deliveries (rather
        # than flushing the producer) lets token events keep batching behind the producer's linger.
        self._retry("publishing results", lambda: self._deliver(results))
        for _, _, sources in batch.terminal:
            for s in sources:
                self._done.put(s)
        for _, sources in batch.custom:
            for s in sources:
                self._done.put(s)

    def _retry(self, what: str, work: Callable[[], T]) -> T:
        while True:
            try:
                return work()
            except Exception:  # noqa: BLE001 - any database or broker error: log and retry
                log.exception("%s failed; retrying", what)
                time.sleep(self._retry_s)

    def _write(self, batch: WriteBatch) -> list[JobResult]:
        results: list[JobResult] = []
        with self._engine.begin() as conn:
            mark_running(conn, batch.running)
            written = finish(conn, [t for t, _, _ in batch.terminal], utcnow())
            results += [r for t, r, _ in batch.terminal if t.job_id in written]
            for work, _ in batch.custom:
                results += work(conn)
        self.written_terminal += len(written)
        return results

    def _deliver(self, results: list[JobResult]) -> None:
        for delivery in [self._publish(result) for result in results]:
            delivery.wait()
