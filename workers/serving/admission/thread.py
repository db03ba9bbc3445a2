"""Admission on a thread of its own: the engine loop never waits for PostgreSQL.

A database that is slow, or unreachable until a connect timeout, would otherwise stall generation for
every job in flight. The loop hands accepted records over and collects decisions later; meanwhile the
admitter retries with backoff, and `blocked` tells the loop to pause intake.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from schemas.job_key import JobKey
from workers.kafka_io import Coordinates, Partition
from workers.serving.admission.admitter import Admitter, Decision
from workers.serving.intake.rejected import Rejected
from workers.serving.intake.validation import Accepted

log = logging.getLogger(__name__)

URGENT = "high"  # the class whose decisions the engine loop waits for (briefly) before a step


class AdmissionThread:
    def __init__(
        self,
        admitter: Admitter,
        is_held: Callable[[Accepted], bool],
        ready: threading.Event,
        tick_s: float = 0.05,
    ) -> None:
        self._admitter = admitter
        self._held_by_loop = is_held
        self._ready = ready  # set when decisions are waiting: it wakes an idle engine loop
        self._tick_s = tick_s
        self._inbox: queue.Queue[list[Accepted] | set[Partition] | None] = queue.Queue()
        self._out: queue.Queue[tuple[list[Decision], list[Rejected]]] = queue.Queue()
        self._lock = threading.Lock()
        self._settled_cv = threading.Condition(self._lock)
        self._outstanding = 0  # records handed over and not yet decided (or dropped)
        self._undelivered = 0  # records decided, their decisions not taken by the loop yet
        self._urgent: set[Coordinates] = set()  # high-priority records not decided yet
        # jobs decided "start" whose decision the engine loop has not settled yet: until it has, a copy
        # of the same job is held here, or it would be re-queued as a second attempt of a job that is
        # about to run (whose first attempt's writes the attempt fence would then refuse)
        self._starting: set[JobKey] = set()  # their keys (Accepted.key)
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inferq-admission", daemon=True)

    # ---- engine-loop side -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def blocked(self) -> bool:
        """Records wait for the database (pause intake until they are through)."""
        return self._admitter.blocked

    def __len__(self) -> int:
        """Records handed over whose decisions the loop has not taken yet: held here, as far as the caps
        go (a decided record is in neither the engine nor admission until the loop takes it)."""
        return self._outstanding + self._undelivered

    def add(self, accepted: list[Accepted]) -> None:
        if accepted:
            with self._lock:
                self._outstanding += len(accepted)
                self._urgent.update(a.record.coordinates for a in accepted if a.priority == URGENT)
            self._inbox.put(list(accepted))
            self._wake.set()

    def wait_urgent(self, timeout_s: float) -> bool:
        """Wait at most timeout_s until no high-priority record awaits its decision; True if none does.

        Its decision is a few milliseconds of PostgreSQL: waiting for it lets the job join the coming
        engine step rather than the one after, a whole step sooner to its first token."""
        with self._settled_cv:
            return self._settled_cv.wait_for(lambda: not self._urgent, timeout_s)

    def drop(self, partitions: set[Partition]) -> None:
        """Forget records of revoked partitions not admitted yet (decisions already made are the caller's
        to filter: their partitions are not owned any more)."""
        self._inbox.put(set(partitions))
        self._wake.set()

    def results(self) -> tuple[list[Decision], list[Rejected]]:
        """Decisions made since the last call; call `settled` once the loop has acted on them."""
        decisions: list[Decision] = []
        rejected: list[Rejected] = []
        while True:
            try:
                d, r = self._out.get_nowait()
            except queue.Empty:
                return decisions, rejected
            decisions += d
            rejected += r
            with self._lock:
                self._undelivered -= len(d) + len(r)

    def settled(self, decisions: list[Decision]) -> None:
        """The loop acted on these decisions: a job started by one is now the loop's to hold."""
        with self._lock:
            for d in decisions:
                if d.outcome.kind == "start":
                    self._starting.discard(d.accepted.key)

    def close(self, timeout_s: float = 5.0) -> None:
        self._inbox.put(None)
        self._wake.set()
        self._thread.join(timeout_s)

    # ---- admission thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(self._tick_s)  # the tick lets backoff retries happen without new records
            self._wake.clear()
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    return
                if isinstance(item, set):
                    before = len(self._admitter)
                    self._admitter.drop(item)
                    with self._lock:
                        dropped = {k for k in self._urgent if (k[0], k[1]) in item}
                    self._settled(before - len(self._admitter), dropped)
                else:
                    self._admitter.add(item)
            try:
                decisions, rejected = self._admitter.run(self._is_held)
            except Exception:  # noqa: BLE001 - never let the thread die: the records stay pending
                log.exception("admission failed unexpectedly; retrying")
                time.sleep(1.0)
                continue
            if decisions or rejected:
                with self._lock:
                    for d in decisions:
                        if d.outcome.kind == "start":
                            self._starting.add(d.accepted.key)
                    self._undelivered += len(decisions) + len(rejected)
                self._out.put((decisions, rejected))
                keys = {d.accepted.record.coordinates for d in decisions} | {
                    r.record.coordinates for r in rejected
                }
                self._settled(len(decisions) + len(rejected), keys)
                self._ready.set()

    def _is_held(self, a: Accepted) -> bool:
        with self._lock:
            starting = a.key in self._starting
        return starting or self._held_by_loop(a)

    def _settled(self, n: int, keys: set[Coordinates]) -> None:
        with self._settled_cv:
            self._outstanding -= n
            self._urgent -= keys
            self._settled_cv.notify_all()
