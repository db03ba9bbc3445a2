"""The worker's engine loop: intake → admission → one engine step → emit → commit → flow control."""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime

from gpu.engine import Engine, EngineStats, RequestOutput
from gpu.engine_process import EngineProcess, EngineProcessDied
from gpu.engine_types import StepFailed
from schemas.job_key import JobKey
from schemas.jobs import TokenEvent
from schemas.validation import Limits
from workers import logs
from workers.clock import utcnow
from workers.db.connect import make_engine
from workers.kafka_io import BroadcastReader, Delivery, GroupConsumer, KeyLookup, Producer
from workers.naming import worker_client_id, worker_group
from workers.serving.admission.models import ServedModels
from workers.serving.announcer import Announcer
from workers.serving.errors import describe_error, until_available
from workers.serving.failpoints import step_fault
from workers.serving.intake.dead_letter import dead_letter_message
from workers.serving.intake.rejected import Rejected
from workers.serving.intake.thread import IntakeThread
from workers.serving.intake.validation import Intake
from workers.serving.loop.clock import LoopClock, thread_seconds
from workers.serving.loop.lifecycle import JobLifecycle
from workers.serving.loop.progress import SAVE_INTERVAL_S
from workers.serving.loop.step_guard import StepGuard
from workers.serving.metrics import WorkerMetrics
from workers.serving.offsets import OffsetTracker
from workers.serving.outbox.persister import Persister
from workers.serving.streaming.sender import RelayProducer, Sent, TokenEventSender
from workers.settings import Settings

log = logging.getLogger(__name__)

HARD_CAP_FACTOR = 2  # jobs held here (all classes) stop at this many times max_waiting: high pauses too
MIN_DRAIN_S = 1.0  # the least a stop gives its last writes (a give-up's deadline is now)
IN_FLIGHT_REFRESH_S = 0.5  # how stale the in-flight list the persister looks cancels up for may be
URGENT_ADMISSION_WAIT_S = 0.05  # before a step, the longest wait for a high-priority job's admission


@dataclass(frozen=True)
class WorkerOptions:
    worker_id: str
    max_waiting: int = 256  # jobs waiting locally before low, then normal, partitions are paused
    # token events of a job are sent at most this often (its first and last at once): 20 updates a second
    # read as smooth streaming, and at saturation it halves the messages Kafka and consumers must handle
    coalesce_ms: float = 50.0
    commit_interval_s: float = 0.2
    idle_wait_s: float = 0.05  # with nothing to do, the loop waits this long for records at most
    # the intake thread's poll timeout: a poll returns as soon as a fetch brings records, so this bounds only
    # how late cancels and the loop's commands (commit, pause) are taken up; each poll hands off to
    # kafka-python's I/O thread, and shorter polls cost the engine thread GIL hand-offs
    poll_s: float = 0.2
    # on a stop (SIGTERM): the bound on handing every running job over (progress saved, partitions
    # released for the group's other workers to resume them) and exiting
    drain_timeout_s: float = 5.0
    # running jobs' new tokens reach PostgreSQL this often (workers/serving/loop/progress.py); 0: never
    save_interval_s: float = SAVE_INTERVAL_S
    max_pending_writes: int = 5000  # row writes waiting for PostgreSQL before intake pauses
    # the Kafka relay process's nice value above the worker's: where cores are short (one-token jobs on a
    # small machine: the loop waited 0.11 ms a job for a core), the loop gets one first; 0: the same
    relay_nice: int = 10
    limits: Limits = Limits()
    # what a job's `model` may name: the base's names and the worker's own adapters (and the registry's)
    models: ServedModels = field(default_factory=ServedModels)
    # the model name announced to the fleet (served_models, what the HTTP API's /v1/models lists); "": none
    served_model: str = ""


class Worker:
    def __init__(
        self,
        settings: Settings,
        engine: Engine | EngineProcess,
        options: WorkerOptions,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.options = options
        self.metrics = metrics or WorkerMetrics()
        topics, conn = settings.topics, settings.kafka_connection
        cid = worker_client_id(options.worker_id)
        # per-tenant topics: a pattern, so a tenant added later is read without a restart (the consumer
        # sees new topics at its next metadata refresh); only tenant topics, where the topic proves the tenant
        group_topics: tuple[str, ...] | str = (*topics.all_jobs, topics.control)
        control_topics: str | re.Pattern[str] = topics.control
        if topics.tenants:
            group_topics = topics.tenant_intake_pattern
            control_topics = re.compile(topics.tenant_control_pattern)
        self.group_topics = group_topics
        where = f"Kafka at {settings.kafka}"
        self.consumer = until_available(
            lambda: GroupConsumer(conn, worker_group(settings.topic_prefix), group_topics, cid), where
        )
        self.control = until_available(lambda: BroadcastReader(conn, control_topics, cid + "-control"), where)
        self.ready = threading.Event()  # records or admission decisions are waiting for the loop
        # dead letters (results leave through the relay); a short block: while the broker is away, sends
        # fail fast and the engine loop keeps generating; sizes checked: one too large must not break it
        self.producer = until_available(lambda: Producer(conn, cid, max_block_s=0.5, check_sizes=True), where)
        drop, log_config = self.metrics.token_events_dropped.inc, (options.worker_id, *logs.current())
        self.events = TokenEventSender(
            conn, cid + "-events", topics.tokens_template, drop, log_config, niceness=options.relay_nice
        )
        self.db = make_engine(settings.database_url)
        self.offsets = OffsetTracker()
        self._in_flight: tuple[JobKey, ...] = ()  # the jobs running here (as of at most a moment ago)
        self._in_flight_due = 0.0
        self.persister = Persister(
            self.db,
            RelayProducer(self.events.link),  # results leave through the relay: no Kafka client work here
            topics,
            options.worker_id,
            dead_letter=self._dead_letter,
            published=KeyLookup(conn, cid + "-lookup"),
            in_flight=self.in_flight,
            failpoint=settings.failpoint,
        )
        # records are validated and tokenized on the intake thread: a 256 KB prompt never stalls a step
        self.intake = Intake.for_engine(topics, options.limits, engine)
        self.intake_thread = IntakeThread(
            self.consumer,
            self.control,
            self.ready,
            options.poll_s,
            prepare=self.intake.decide,
            first=self._before_low,  # interactive jobs are never read behind a bulk backlog
        )
        self.lifecycle = JobLifecycle(
            engine,
            topics,
            worker_id=options.worker_id,
            limits=options.limits,
            coalesce_s=options.coalesce_ms / 1000,
            database=self.db,
            ready=self.ready,
            offsets=self.offsets,
            owner=self.intake_thread,  # its consumer's assignment: the partitions this worker owns
            metrics=self.metrics,
            write=self.persister.submit,
            send_event=self.send_token_event,
            save_interval_s=options.save_interval_s,
            models=options.models,
        )
        self.guard = StepGuard()
        self.announcer: Announcer | None = None
        if options.served_model:
            max_len = engine.scheduler.config.max_model_len
            self.announcer = Announcer(
                self.db, options.worker_id, settings.topic_prefix, options.served_model, max_len
            )
        self.gave_up: str | None = None  # why the worker stopped because its steps kept failing
        if isinstance(engine, Engine):  # an engine in its own process has its hook set there
            engine.fault_hook = step_fault(settings.failpoint, self.lifecycle.prompt_of)
        self._stop_at: float | None = None
        self._last_commit = 0.0
        self._paused: set[str] = set()
        self._waiting = 0  # sequences waiting in the engine, as of the last iteration
        self._next_intake_metrics = 0.0
        self.clock = LoopClock()

    # ---- lifecycle -------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop (a signal handler calls it): no new jobs; the loop ends after this iteration, and every job
        running here is handed over to the group (its progress saved) within the drain timeout."""
        if self._stop_at is None:
            self._stop_at = time.monotonic() + self.options.drain_timeout_s
            self.intake_thread.stop_intake()
            in_flight, drain = len(self.lifecycle.jobs), self.options.drain_timeout_s
            log.info("stopping: no new jobs; handing %d in flight over within %.1fs", in_flight, drain)

    @property
    def stopping(self) -> bool:
        return self._stop_at is not None

    def run(self) -> None:
        self.persister.start()
        self.lifecycle.admitter.start()
        self.intake_thread.room = self._room()  # the first poll is bounded too
        self.intake_thread.start()
        if self.announcer is not None:  # once it reads its topics: the API lists it from now on
            self.announcer.start()
        serving = self.group_topics if isinstance(self.group_topics, str) else ", ".join(self.group_topics)
        log.info("worker %s serving %s", self.options.worker_id, serving)
        try:
            while not self._done():
                self.run_once()
        finally:
            self._shutdown()

    def _done(self) -> bool:
        return self._stop_at is not None

    def run_once(self) -> None:
        """One iteration: intake, admission, cancels, one engine step, emit, commit, flow control."""
        clock = self.clock
        clock.start()
        self._handle_rebalances()
        clock.lap("rebalance")
        if not self.engine.has_unfinished():
            self.ready.wait(self.options.idle_wait_s)  # idle: sleep until records or decisions arrive
            self.ready.clear()
            clock.lap("idle")
        if not self.stopping:
            self.lifecycle.intake(self.intake_thread.records())
        clock.lap("intake")
        if not self.lifecycle.admitter.blocked:  # (while the database is away nobody waits for it)
            self.lifecycle.admitter.wait_urgent(URGENT_ADMISSION_WAIT_S)
        self.lifecycle.admit_pending()
        clock.lap("admission")
        self.lifecycle.broadcast(self.intake_thread.broadcast_records())
        for key in self.persister.cancelled():
            self.lifecycle.cancel(key)
        if time.monotonic() >= self._in_flight_due:  # read by the persister's cancel lookups
            self._in_flight_due = time.monotonic() + IN_FLIGHT_REFRESH_S
            self._in_flight = tuple(j.key for j in self.lifecycle.jobs.values())
        clock.lap("control")
        if self.engine.has_unfinished():
            step_started = utcnow()
            probe = self.guard.next_step(self.engine.running_ids()) if self.guard.isolating else None
            try:
                outputs = self.engine.step(probe)
            except StepFailed as failed:  # one bad step must not stop the worker (or the group)
                outputs = failed.outputs
                self._step_failed(failed)
            except EngineProcessDied as died:  # no engine: stop, ending nobody's job (others redo them)
                outputs = []
                self._give_up(str(died), "no engine")
            else:
                if self.guard.engaged:  # the common step skips this: nothing has failed
                    self._convict(self.guard.succeeded(self.engine.last_step))
            clock.lap("step")
            self.handle_outputs(outputs, step_started)
            clock.lap("outputs")
        elif self.guard.held():  # only held jobs are left: no step can show the device works
            self._convict(self.guard.convict_when_idle())
        self.lifecycle.flush(force=False)
        clock.lap("flush")
        self._commit(force=False)
        clock.lap("commit")
        stats = self.engine.stats()
        self._waiting = sum(stats.waiting.values())
        self._flow_control()
        self.intake_thread.room = self._room()  # after: it depends on the classes left open
        self._observe(stats)
        clock.lap("flow")

    def handle_outputs(self, outputs: list[RequestOutput], step_started: datetime) -> None:
        for out in outputs:
            try:
                self.lifecycle.on_output(out, step_started)
            except Exception as exc:  # noqa: BLE001 - e.g. detokenizing: that job fails, the others go on
                log.exception("job %s: its output could not be handled", out.request_id)
                self.lifecycle.fail(out.request_id, f"output handling failed: {describe_error(exc)}")

    def _step_failed(self, failed: StepFailed) -> None:
        """Which sequence broke the step is unknown, or whether any did: its sequences are run alone until
        the one at fault shows (see StepGuard), and after too many failed steps in a row the device is
        taken to be at fault: the worker gives up without failing anyone, so others redo the jobs."""
        cause = failed.__cause__ or failed
        log.error("engine step of %d sequences failed: %s", len(failed.seq_ids), describe_error(cause),
                  exc_info=cause)  # fmt: skip
        self.metrics.engine_step_failures.inc()
        self.metrics.set_health(False, "engine steps failing")
        held = self.guard.failed(failed.seq_ids, f"engine step failed: {describe_error(cause)}")
        if held is not None:
            log.warning("job %s failed a step alone: held until a working step convicts it", held)
            self.lifecycle.hold(held)
        if self.guard.gave_up:
            self._give_up(f"{self.guard.consecutive} engine steps in a row failed")

    def _convict(self, convicted: dict[str, str]) -> None:
        if not self.guard.isolating and not self.guard.held():
            self.metrics.set_health(True)
        for request_id, error in convicted.items():
            log.error("job %s: its steps fail and others' do not; it ends failed", request_id)
            self.lifecycle.fail(request_id, error)

    def _give_up(self, why: str, fault: str = "the device is at fault") -> None:
        """The device (or the engine's process), not a request, is at fault: stop at once, writing no row,
        so the group's other workers redo these jobs from their uncommitted records."""
        log.critical("%s: %s; stopping without ending any job here", why, fault)
        self.metrics.set_health(False, why)
        self.gave_up = why
        self.lifecycle.abort_all()
        self._stop_at = time.monotonic()
        self.intake_thread.stop_intake()

    def in_flight(self) -> tuple[JobKey, ...]:
        """The jobs running here, as of the loop's last iteration (read by the persister's thread)."""
        return self._in_flight

    # ---- Kafka out -------------------------------------------------------------------------
    def send_token_event(self, event: TokenEvent, tenant: str) -> Sent | None:
        """Queued for the sender thread; the last event of an attempt comes back as a handle to wait on."""
        return self.events.send(event, tenant, track=event.usage is not None)

    def _dead_letter(self, r: Rejected) -> Delivery:
        """The record as it came (cut to what the broker accepts), with why it was refused in headers."""
        key, value, headers = dead_letter_message(r, self.options.limits.dlq_max_bytes)
        return self.producer.send(self.settings.topics.dlq, key, value, headers)

    # ---- group, offsets, flow control ------------------------------------------------------
    def _handle_rebalances(self) -> None:
        """Cooperative rebalancing: a revoked or lost partition's jobs stop here (its new owner redoes them);
        an assigned one is read from its committed offset, so nothing done here is skipped."""
        for event in self.consumer.rebalances():
            parts = set(event.partitions)
            if event.kind in ("revoked", "lost"):
                self.lifecycle.revoke(parts)
                self.offsets.forget(parts)
                log.info("partitions %s: %s", event.kind, sorted(parts))
                continue
            log.info("partitions assigned: %s", sorted(parts))

    def _held(self) -> int:
        """Jobs this worker holds but does not run yet: waiting in the engine or for their admission."""
        return self._waiting + len(self.lifecycle.admitter)

    def _before_low(self, topic: str) -> bool:
        """Topics read before the low class's: the higher jobs classes, and control (its cancels)."""
        topics = self.settings.topics
        return not topics.is_jobs(topic) or topics.priority_of(topic) != "low"

    def _caps(self) -> dict[str, int]:
        """Jobs held here at which each class's partitions pause (they resume below three quarters)."""
        limit = self.options.max_waiting
        return {"low": limit, "normal": int(limit * 1.5), "high": HARD_CAP_FACTOR * limit}

    def _job_topics(self) -> set[str]:
        """The job topics of this worker's partitions."""
        topics = self.settings.topics
        assigned = {t for t, _ in self.intake_thread.assignment if topics.is_jobs(t)}
        return assigned if topics.tenants else assigned | set(topics.all_jobs)

    def _room(self) -> int:
        """Records the next poll may bring. A poll returns records of every class not paused, so it takes
        no more than the lowest of them may still add: a backlog of low jobs never fills the room (and so
        pauses the partitions) that a high job posted after it needs."""
        topics, caps = self.settings.topics, self._caps()
        open_classes = {topics.priority_of(t) for t in self._job_topics() - self._paused} or set(caps)
        return max(0, min(caps[p] for p in open_classes) - self._held())

    def _flow_control(self) -> None:
        """Pause intake while admission waits for the database or row writes pile up; otherwise pause low,
        then normal, then high partitions as the jobs held here grow: a backlog waits in Kafka, not here."""
        waiting, topics = self._held(), self.settings.topics
        # the topics of this worker's partitions (with per-tenant topics, those are known only so)
        assigned = {t for t, _ in self.intake_thread.assignment}
        if not topics.tenants:
            assigned |= {*topics.all_jobs, topics.control}
        if self.lifecycle.admitter.blocked or self.persister.depth >= self.options.max_pending_writes:
            wanted = assigned
        else:
            wanted = {t for t in self._paused if topics.is_jobs(t)}
            for priority, threshold in self._caps().items():
                of_class = {t for t in assigned if topics.is_jobs(t) and topics.priority_of(t) == priority}
                if waiting >= threshold:
                    wanted |= of_class
                elif waiting < threshold * 3 // 4:
                    wanted -= of_class
        if wanted - self._paused:
            self.intake_thread.request(lambda c, topics=wanted - self._paused: c.pause(topics))
            log.debug("pausing %s (%d jobs waiting)", sorted(wanted - self._paused), waiting)
        if self._paused - wanted:
            self.intake_thread.request(lambda c, topics=self._paused - wanted: c.resume(topics))
            log.debug("resuming %s (%d jobs waiting)", sorted(self._paused - wanted), waiting)
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
        owned = self.intake_thread.assignment
        offsets = {p: o for p, o in self.offsets.committable().items() if p in owned}
        if offsets and force:  # at shutdown, once the intake thread has stopped: the consumer is ours
            if self.consumer.commit_sync(offsets):
                self.offsets.committed(offsets)
        elif offsets:
            self.intake_thread.request(lambda c: c.commit(offsets))

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
        self.metrics.observe_intake(self.intake_thread.lag, p.depth, p.oldest_age_s, p.unpublished)
        self.metrics.observe_membership(self.intake_thread.membership)
        self.metrics.observe_loop(self.clock.seconds, thread_seconds())
        jobs = [j for j in self.lifecycle.jobs.values() if j.lora_name]
        running = [j.lora_name for j in jobs if j.started_at is not None]
        self.metrics.observe_loras(running, [j.lora_name for j in jobs if j.started_at is None])

    def _shutdown(self) -> None:
        """Hand over and leave, within the drain timeout: every job running here stops without a terminal
        row, its progress saved, and the consumer leaves the group once the rows are written (the group
        gives its partitions to the others at once, who resume the jobs from their uncommitted records).
        What a dead database or broker holds past the deadline is left behind: the next owner redoes
        it from older progress, or from scratch."""
        deadline = self._stop_at if self._stop_at is not None else time.monotonic()
        deadline = max(deadline, time.monotonic() + MIN_DRAIN_S)  # a give-up still writes what it can

        def left(at_most: float = 10.0) -> float:
            return max(0.05, min(at_most, deadline - time.monotonic()))

        if self.announcer is not None:  # first: the API stops listing a worker that takes no more jobs
            self.announcer.stop(left(1.0))
        self.lifecycle.admitter.close(left(1.0))  # records not admitted yet stay uncommitted: redelivered
        handed = self.lifecycle.abort_all()  # their progress queued for the persister
        self.lifecycle.flush(force=True)
        self.events.stop(left())  # the last token events reach the relay before the results after them
        self.persister.close(left())
        self.events.close(left())
        self.intake_thread.stop(left())
        self._commit(force=True)
        self.producer.flush(left())
        self.producer.close()
        self.control.close()
        self.consumer.close()  # leaves the group: the others take its partitions now
        self.db.dispose()
        if handed:
            log.info("handed %d running jobs over to the group", handed)
        s = self.engine.stats()
        log.info(
            "worker %s stopped: model %.1fs over %d steps; busy loop time by phase: %s",
            self.options.worker_id, s.forward_seconds, s.steps, self.clock.summary(),
        )  # fmt: skip
