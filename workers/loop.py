"""The worker's engine loop: intake → admission → one engine step → emit → commit → flow control."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime

from gpu.engine import Engine, EngineStats, RequestOutput
from schemas.jobs import TokenEvent
from schemas.validation import Limits
from workers.dispatch import Dispatcher
from workers.inflight import utcnow
from workers.kafka_io import BroadcastReader, Delivery, GroupConsumer, Partition, Producer
from workers.metrics import WorkerMetrics
from workers.offsets import OffsetTracker
from workers.persister import Persister
from workers.settings import Settings
from workers.store import make_engine
from workers.writes import Rejected

log = logging.getLogger(__name__)

REASSIGN_WINDOW_S = 60.0  # a partition handed back this soon after its revocation resumes where we left it
TOKEN_SEND_PAUSE_S = 2.0  # after a token event could not be sent, drop events this long without trying


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
    max_pending_writes: int = 5000  # row writes waiting for PostgreSQL before intake pauses
    limits: Limits = Limits()


class Worker:
    def __init__(
        self, settings: Settings, engine: Engine, options: WorkerOptions, metrics: WorkerMetrics | None = None
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.options = options
        self.metrics = metrics or WorkerMetrics()
        topics, conn = settings.topics, settings.kafka_connection
        cid = f"inferq-{options.worker_id}"
        self.group_topics = (*topics.all_jobs, topics.control)
        self.consumer = GroupConsumer(conn, group_id(settings.topic_prefix), self.group_topics, cid)
        self.control = BroadcastReader(conn, topics.control, cid + "-control")
        # a short block: while the broker is away, sends fail fast and the engine loop keeps generating
        self.producer = Producer(conn, cid, max_block_s=0.5)
        self.db = make_engine(settings.database_url)
        self.offsets = OffsetTracker()
        self._in_flight: tuple[str, ...] = ()
        self.persister = Persister(
            self.db,
            self.producer,
            topics,
            options.worker_id,
            dead_letter=self._dead_letter,
            in_flight=lambda: self._in_flight,
            failpoint=settings.failpoint,
        )
        self.dispatch = Dispatcher(self, topics)
        self._stop_at: float | None = None
        self._last_commit = 0.0
        self._paused: set[str] = set()
        self._revoked: dict[Partition, tuple[float, int]] = {}  # partition -> (when, where we had got to)
        self._waiting = 0  # sequences waiting in the engine, as of the last iteration
        self._next_poll = 0.0
        self._next_control = 0.0
        self._token_sends_paused_until = 0.0
        self._next_intake_metrics = 0.0
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
        log.info("worker %s serving %s", self.options.worker_id, ", ".join(self.group_topics))
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
        """One iteration: intake, admission, cancels, one engine step, emit, commit, flow control."""
        self._handle_rebalances()
        busy = self.engine.has_unfinished()
        now = time.monotonic()
        if not self.stopping and (not busy or now >= self._next_poll):
            self._next_poll = now + self.options.busy_poll_s
            self.dispatch.intake(self.consumer.poll(0.0 if busy else self.options.idle_poll_s, self._room()))
        self.dispatch.admit_pending()
        if not busy or now >= self._next_control:
            self._next_control = now + self.options.control_poll_s
            self.dispatch.broadcast(self.control.poll(0.0))
            for job_id in self.persister.cancelled():
                self.dispatch.cancel(job_id)
            self._in_flight = tuple(self.dispatch.jobs)
        t0 = time.monotonic()
        if self.engine.has_unfinished():
            step_started = utcnow()
            self.handle_outputs(self.engine.step(), step_started)
            self._step_s += time.monotonic() - t0
        self.dispatch.flush(force=False)
        self._commit(force=False)
        stats = self.engine.stats()
        self._waiting = sum(stats.waiting.values())
        self._flow_control()
        self._observe(stats)
        if busy:
            self._busy_s += time.monotonic() - now

    def handle_outputs(self, outputs: list[RequestOutput], step_started: datetime) -> None:
        for out in outputs:
            self.dispatch.on_output(out, step_started)

    # ---- Kafka out -------------------------------------------------------------------------
    def send_token_event(self, event: TokenEvent) -> Delivery | None:
        """Best effort while the broker is away: the final result never depends on token events."""
        if time.monotonic() < self._token_sends_paused_until:
            self.metrics.token_events_dropped.inc()
            return None
        try:
            return self.producer.send(
                self.settings.topics.tokens, event.job_id, event.model_dump_json().encode()
            )
        except Exception as exc:  # noqa: BLE001 - buffer full or no metadata: drop, keep generating
            self._token_sends_paused_until = time.monotonic() + TOKEN_SEND_PAUSE_S
            self.metrics.token_events_dropped.inc()
            log.warning("token events are being dropped for %.0fs: %s", TOKEN_SEND_PAUSE_S, exc)
            return None

    def _dead_letter(self, r: Rejected) -> Delivery:
        """The record as it came (cut to what the broker accepts), with why it was refused in headers."""
        rec, limit = r.record, self.options.limits.dlq_max_bytes
        value = rec.value or b""
        headers = [
            ("source_topic", rec.topic.encode()),
            ("source_partition", str(rec.partition).encode()),
            ("source_offset", str(rec.offset).encode()),
            ("error", r.error.encode()[:4000]),
            ("reason", r.reason.encode()),
            ("original_size", str(len(value)).encode()),
            ("truncated", b"true" if len(value) > limit else b"false"),
        ]
        key = rec.key[:4096] if rec.key else rec.key
        return self.producer.send(self.settings.topics.dlq, key, value[:limit], headers)

    # ---- group, offsets, flow control ------------------------------------------------------
    def _handle_rebalances(self) -> None:
        now = time.monotonic()
        for event in self.consumer.rebalances():
            parts = set(event.partitions)
            if event.kind in ("revoked", "lost"):
                for p in parts:
                    position = self.offsets.position(p)
                    if position is not None:
                        self._revoked[p] = (now, position)
                self.dispatch.revoke(parts)
                self.offsets.forget(parts)
                log.info("partitions %s: %s", event.kind, sorted(parts))
                continue
            self._paused.clear()  # newly owned partitions start unpaused: flow control re-applies
            for p in parts:
                # Under eager rebalancing a partition can come back with the fetch position it had, past the
                # jobs just aborted: resume from the first one not done (cooperative rebalancing never does).
                seen = self._revoked.pop(p, None)
                if seen is not None and now - seen[0] < REASSIGN_WINDOW_S:
                    self.consumer.seek(p, seen[1])
            log.info("partitions assigned: %s", sorted(parts))

    def _room(self) -> int:
        return max(1, 2 * self.options.max_waiting - self._waiting)

    def _flow_control(self) -> None:
        """Pause intake while admission waits for the database or row writes pile up; otherwise pause low,
        then normal, partitions when the local queue is full (high keeps flowing)."""
        waiting, limit = self._waiting, self.options.max_waiting
        topics = self.settings.topics
        if self.dispatch.admitter.blocked or self.persister.depth >= self.options.max_pending_writes:
            wanted = set(self.group_topics)
        else:
            wanted = {t for t in self._paused if t in (topics.jobs("low"), topics.jobs("normal"))}
            for priority, threshold in (("low", limit), ("normal", int(limit * 1.5))):
                topic = topics.jobs(priority)
                if waiting >= threshold:
                    wanted.add(topic)
                elif waiting < threshold * 3 // 4:
                    wanted.discard(topic)
        if wanted - self._paused:
            self.consumer.pause(wanted - self._paused)
            log.debug("paused %s (%d jobs waiting)", sorted(wanted - self._paused), waiting)
        if self._paused - wanted:
            self.consumer.resume(self._paused - wanted)
            log.debug("resumed %s (%d jobs waiting)", sorted(self._paused - wanted), waiting)
        self._paused = wanted

    def _commit(self, force: bool) -> None:
        for topic, partition, offset in self.persister.acked():
            self.offsets.ack((topic, partition), offset)
        for done in self.consumer.committed():
            self.offsets.committed(done)
        now = time.monotonic()
        if not force and now - self._last_commit < self.options.commit_interval_s:
            return
        self._last_commit = now
        owned = self.consumer.assignment()
        offsets = {p: o for p, o in self.offsets.committable().items() if p in owned}
        if offsets and force:
            if self.consumer.commit_sync(offsets):
                self.offsets.committed(offsets)
        elif offsets:
            self.consumer.commit(offsets)

    def _observe(self, s: EngineStats) -> None:
        waiting = {p.name.lower(): n for p, n in s.waiting.items()}
        self.metrics.observe_engine(
            s.running, waiting, s.kv_blocks_used, s.kv_blocks_total, s.preemptions, s.prefix_cache_hits
        )
        now = time.monotonic()
        if now < self._next_intake_metrics:
            return
        self._next_intake_metrics = now + 1.0
        p = self.persister.stats()
        self.metrics.observe_intake(self.consumer.lag(), p.depth, p.oldest_age_s, p.unpublished)

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
