"""The Kafka intake on a thread of its own, so the engine loop never pays for a poll.

kafka-python's consumers are not thread-safe, and every poll costs its caller Python time (hand-offs to the
client's I/O thread) that the engine loop would otherwise pay each iteration. This thread owns the group
consumer and the control reader: it polls them, validates and tokenizes job records, hands them over in
queues, and runs the loop's requests (pause, resume, seek, commit) between polls. Most of a step runs in
torch kernels that release the GIL, so on a core of its own this thread costs the engine almost nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from workers.kafka_io import BroadcastReader, GroupConsumer, Membership, Partition, Record

log = logging.getLogger(__name__)

Command = Callable[[GroupConsumer], None]
Prepared = tuple[Record, Any]  # a record and what `prepare` made of it
FULL_WAIT_S = 0.02  # with no room, how often the thread looks again (and runs the loop's requests)
FULL_POLL_INTERVAL_S = 30.0  # with no room, a poll of one record this often keeps the group membership


class IntakeThread:
    def __init__(
        self,
        consumer: GroupConsumer,
        control: BroadcastReader,
        ready: threading.Event,
        poll_s: float = 0.2,
        control_poll_s: float = 0.1,
        prepare: Callable[[Record], Any] = lambda record: None,
        first: Callable[[str], bool] | None = None,
    ) -> None:
        """first: topics whose records each poll takes before any other's (see GroupConsumer.poll)."""
        self.consumer = consumer  # touched by this thread only, until stop()
        self._control = control
        self._poll_s = poll_s
        self._control_poll_s = control_poll_s
        self._prepare = prepare  # must not raise: it turns a record's failure into a decision
        self._first = first
        self._records: queue.Queue[list[Prepared]] = queue.Queue()
        self._queued = 0  # records handed over but not taken by the loop yet
        self._queued_lock = threading.Lock()
        self._control_records: queue.Queue[list[Record]] = queue.Queue()
        self._commands: queue.Queue[Command] = queue.Queue()
        self._stop = threading.Event()
        self._intake_stopped = threading.Event()  # shutdown: keep the membership, read no more jobs
        self._ready = ready  # set when records arrive: it wakes an idle engine loop
        self._thread = threading.Thread(target=self._run, name="inferq-intake", daemon=True)
        # written by this thread, read by the engine loop (a reference swap each time: no torn reads)
        self.room = 0  # jobs the loop can take now; written by the loop
        self.assignment: frozenset[Partition] = frozenset()
        self.lag: dict[Partition, int] = {}
        self.membership = Membership(member=False, out_for_s=0.0, losses=0)

    # ---- engine-loop side -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def records(self) -> list[Prepared]:
        """Job and control records fetched since the last call, prepared, in fetch order, for owned
        partitions."""
        out: list[Prepared] = []
        while True:
            try:
                out += self._records.get_nowait()
            except queue.Empty:
                break
        with self._queued_lock:
            self._queued -= len(out)
        self.room = max(0, self.room - len(out))  # taken: no room for them again until the loop says so
        owned = self.assignment
        return [p for p in out if p[0].source in owned]  # fetched before a revocation: not ours any more

    def broadcast_records(self) -> list[Record]:
        out: list[Record] = []
        while True:
            try:
                out += self._control_records.get_nowait()
            except queue.Empty:
                return out

    def request(self, command: Command) -> None:
        """Run `command(consumer)` on the intake thread, before its next poll."""
        self._commands.put(command)

    def stop_intake(self) -> None:
        self._intake_stopped.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (pending requests run first); the consumers are the caller's again."""
        self._stop.set()
        self._thread.join(timeout_s)
        self._run_commands()

    # ---- intake thread ------------------------------------------------------------------------
    def _run(self) -> None:
        next_control = next_lag = last_poll = 0.0
        while not self._stop.is_set():
            try:
                self._run_commands()
                now = time.monotonic()
                if now >= next_control:
                    next_control = now + self._control_poll_s
                    control = self._control.poll(0.0)
                    if control:
                        self._control_records.put(control)
                        self._ready.set()
                if self._intake_stopped.is_set():
                    time.sleep(self._poll_s)
                    continue
                # at most the room the loop left, less what it has not taken yet; a full worker polls
                # only now and then (its membership needs a poll every max.poll.interval)
                budget = self.room - self._queued
                if budget <= 0 and now - last_poll < FULL_POLL_INTERVAL_S:
                    time.sleep(FULL_WAIT_S)
                    continue
                last_poll = now
                # while topics are held, the loop's resume runs only between polls: a poll blocked for
                # poll_s would hold a drained worker idle that long (a burst had 1-3 such 200 ms stalls)
                timeout_s = FULL_WAIT_S if self.consumer.holding else self._poll_s
                records = self.consumer.poll(timeout_s, max(1, budget), self._first)
                self.assignment = frozenset(self.consumer.assignment())
                if records:
                    with self._queued_lock:
                        self._queued += len(records)
                    self._records.put([(r, self._prepare(r)) for r in records])
                    self._ready.set()
                if now >= next_lag:
                    next_lag = now + 1.0
                    self.lag = self.consumer.lag()
                    self.membership = self.consumer.membership()
            except Exception:  # noqa: BLE001 - the intake thread must outlive any one failure
                log.exception("intake thread: unexpected error; going on")
                time.sleep(self._poll_s)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command(self.consumer)
            except Exception:  # noqa: BLE001
                log.exception("intake thread: a consumer request failed")
