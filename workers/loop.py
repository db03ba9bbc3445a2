"""The worker's engine loop: intake → one engine step (schedule + execute) → emit → commit."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime

from gpu.engine import Engine, EngineStats, RequestOutput
from schemas.validation import Limits
from workers.dispatch import Dispatcher
from workers.inflight import utcnow
from workers.kafka_io import BroadcastReader, GroupConsumer, Producer
from workers.metrics import WorkerMetrics
from workers.offsets import OffsetTracker
from workers.persister import Persister
from workers.settings import Settings
from workers.store import make_engine

log = logging.getLogger(__name__)


def group_id(topic_prefix: str) -> str:
    """`inferq-workers` for the default prefix: each deployment (prefix) has its own consumer group."""
    return f"{topic_prefix}-workers"


@dataclass(frozen=True)
class WorkerOptions:
    worker_id: str
    max_waiting: int = 256  # jobs waiting locally before low, then normal, partitions are paused
    # token events of a job are sent at most this often (its first and last at once): 20 updates a second
    # read as smooth streaming, and at saturation it halves the messages Kafka and consumers must handle
    coalesce_ms: float = 50.0
    commit_interval_s: float = 0.2
    idle_poll_s: float = 0.05  # poll timeout when the engine has nothing to do
    # While the engine is busy, poll Kafka at most this often: each poll wakes the client's I/O thread,
    # and on a loaded machine those wake-ups cost the engine more than a few ms of intake latency.
    busy_poll_s: float = 0.02
    control_poll_s: float = 0.1
    grace_s: float = 30.0  # on shutdown, time to finish in-flight jobs before aborting them
    limits: Limits = Limits()


class Worker:
    def __init__(
        self, settings: Settings, engine: Engine, options: WorkerOptions, metrics: WorkerMetrics | None = None
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.options = options
        self.metrics = metrics or WorkerMetrics()
        topics = settings.topics
        cid = f"inferq-{options.worker_id}"
        self.consumer = GroupConsumer(settings.kafka, group_id(settings.topic_prefix), topics.all_jobs, cid)
        self.control = BroadcastReader(settings.kafka, topics.control, cid + "-control")
        self.producer = Producer(settings.kafka, cid)
        self.db = make_engine(settings.database_url)
        self.offsets = OffsetTracker()
        self.persister = Persister(
            self.db,
            publish=lambda r: self.producer.send(topics.results, r.job_id, r.model_dump_json().encode()),
        )
        self.dispatch = Dispatcher(self, topics)
        self._stop_at: float | None = None
        self._last_commit = 0.0
        self._paused: set[str] = set()
        self._waiting = 0  # sequences waiting in the engine, as of the last iteration
        self._next_poll = 0.0
        self._next_control = 0.0
        self._busy_s = 0.0  # wall time of iterations that stepped the engine
        self._step_s = 0.0  # of which inside engine.step()

    # ---- lifecycle -------------------------------------------------------------------------
    def request_stop(self) -> None:
        if self._stop_at is None:
            self._stop_at = time.monotonic() + self.options.grace_s
            in_flight, grace = len(self.dispatch.jobs), self.options.grace_s
            log.info("stopping: no new jobs; %d in flight get %.0fs", in_flight, grace)

    @property
    def stopping(self) -> bool:
        return self._stop_at is not None

    def run(self) -> None:
        self.persister.start()
        log.info("worker %s serving %s", self.options.worker_id, ", ".join(self.settings.topics.all_jobs))
        try:
            while not self._done():
                self.run_once()
        finally:
            self._shutdown()

    def _done(self) -> bool:
        if self._stop_at is None:
            return False
        return not self.dispatch.jobs or time.monotonic() >= self._stop_at

    def run_once(self) -> None:
        """One iteration: intake, one engine step, emit, commit."""
        self.dispatch.handle_rebalances(self.consumer.rebalances.drain())
        busy = self.engine.has_unfinished()
        now = time.monotonic()
        if not self.stopping and (not busy or now >= self._next_poll):
            self._next_poll = now + self.options.busy_poll_s
            records = self.consumer.poll(0.0 if busy else self.options.idle_poll_s, self._room())
            self.dispatch.intake(records)
        if not busy or now >= self._next_control:
            self._next_control = now + self.options.control_poll_s
            self.dispatch.control(self.control.poll(0.0))
        t0 = time.monotonic()
        if self.engine.has_unfinished():
            step_started = utcnow()
            self.handle_outputs(self.engine.step(), step_started)
            self._step_s += time.monotonic() - t0
        self.dispatch.flush(force=False)
        self._commit(force=False)
        stats = self.engine.stats()
        self._waiting = sum(stats.waiting.values())
        self._backpressure()
        self._observe(stats)
        if busy:
            self._busy_s += time.monotonic() - now

    def handle_outputs(self, outputs: list[RequestOutput], step_started: datetime) -> None:
        for out in outputs:
            self.dispatch.on_output(out, step_started)

    # ---- flow control ----------------------------------------------------------------------
    def _room(self) -> int:
        return max(1, 2 * self.options.max_waiting - self._waiting)

    def _backpressure(self) -> None:
        """Pause low, then normal, partitions when the local queue is full; high keeps flowing."""
        waiting, limit = self._waiting, self.options.max_waiting
        topics = self.settings.topics
        for priority, threshold in (("low", limit), ("normal", int(limit * 1.5))):
            topic = topics.jobs(priority)
            if topic not in self._paused and waiting >= threshold:
                self.consumer.pause([topic])
                self._paused.add(topic)
                log.debug("paused %s: %d jobs waiting", topic, waiting)
            elif topic in self._paused and waiting < threshold * 3 // 4:
                self.consumer.resume([topic])
                self._paused.discard(topic)
                log.debug("resumed %s: %d jobs waiting", topic, waiting)

    def _commit(self, force: bool) -> None:
        for topic, partition, offset in self.persister.acked():
            self.offsets.ack((topic, partition), offset)
        now = time.monotonic()
        if not force and now - self._last_commit < self.options.commit_interval_s:
            return
        self._last_commit = now
        offsets = self.offsets.committable()
        owned = self.consumer.assignment()
        offsets = {p: o for p, o in offsets.items() if p in owned}
        if offsets and self.consumer.commit(offsets):
            self.offsets.committed(offsets)

    def _observe(self, s: EngineStats) -> None:
        waiting = {p.name.lower(): n for p, n in s.waiting.items()}
        self.metrics.observe_engine(s.running, waiting, s.kv_blocks_used, s.kv_blocks_total, s.preemptions)

    def _shutdown(self) -> None:
        self.dispatch.abort_all()  # past the grace period: no terminal row, the group redoes them
        self.dispatch.flush(force=True)
        self.persister.close()
        self._commit(force=True)
        self.producer.flush(10)
        self.producer.close()
        self.control.close()
        self.consumer.close()
        self.db.dispose()
        s = self.engine.stats()
        log.info(
            "worker %s stopped: busy %.1fs, of which engine steps %.1fs (model %.1fs over %d steps)",
            self.options.worker_id, self._busy_s, self._step_s, s.forward_seconds, s.steps,
        )  # fmt: skip
