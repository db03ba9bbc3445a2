"""Per-job bookkeeping of the worker: admit, reject, cancel, stream, conclude, and revoke on rebalance."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from gpu.engine import EngineRequest, RequestOutput
from scheduler.types import Priority, SamplingParams
from schemas.jobs import JobResult, TokenEvent, Usage
from schemas.topics import Topics
from schemas.validation import InvalidMessage, parse_control
from workers.inflight import InFlightJob, utcnow
from workers.intake import Accepted, Intake, Rejected
from workers.kafka_io import Record
from workers.persister import WriteBatch
from workers.store import Admission, admit, insert_terminal
from workers.streaming import TokenStreamer

if TYPE_CHECKING:
    from workers.loop import Worker

log = logging.getLogger(__name__)

PRIORITIES = {"high": Priority.HIGH, "normal": Priority.NORMAL, "low": Priority.LOW}


def _kafka_time(record: Record) -> datetime:
    return datetime.fromtimestamp(record.timestamp_ms / 1000, UTC) if record.timestamp_ms > 0 else utcnow()


class Dispatcher:
    def __init__(self, worker: Worker, topics: Topics) -> None:
        self.w = worker
        self.topics = topics
        self.jobs: dict[str, InFlightJob] = {}
        engine = worker.engine
        max_model_len = engine.scheduler.config.max_model_len
        self.intake_rules = Intake(topics, worker.options.limits, engine.tokenizer, max_model_len)
        self.streamer = TokenStreamer(self._send_token_event, worker.options.coalesce_ms / 1000)
        self.batch = WriteBatch()

    # ---- intake ----------------------------------------------------------------------------
    def intake(self, records: list[Record]) -> None:
        fresh: dict[str, Accepted] = {}
        duplicates: list[tuple[str, Record]] = []  # same job_id twice: acked together with the first
        for record in records:
            self.w.offsets.track(record.source, record.offset)
            decision = self.intake_rules.accept(record)
            if isinstance(decision, Rejected):
                self._reject(decision)
            elif decision.job_id in self.jobs or decision.job_id in fresh:
                duplicates.append((decision.job_id, record))
            else:
                fresh[decision.job_id] = decision
        if fresh:
            self._admit(list(fresh.values()))
        for job_id, record in duplicates:
            if job_id in self.jobs:
                self.jobs[job_id].sources.append(self._src(record))
            else:  # the first copy was already terminal
                self.w.offsets.ack(record.source, record.offset)

    @staticmethod
    def _src(record: Record) -> tuple[str, int, int]:
        return (record.topic, record.partition, record.offset)

    def _admit(self, accepted: list[Accepted]) -> None:
        now = utcnow()
        rows = [
            Admission(
                job_id=a.job_id,
                tenant=a.job.tenant,
                priority=a.priority,
                prompt=a.prompt_text,
                params=a.job.model_dump(mode="json", exclude={"prompt", "messages", "job_id"}),
                bulk_id=a.job.bulk_id,
                created_at=_kafka_time(a.record),
                queued_at=now,
                worker_id=self.w.options.worker_id,
                source=self._src(a.record),
            )
            for a in accepted
        ]
        with self.w.db.begin() as conn:
            attempts = admit(conn, rows)
        for a in accepted:
            if a.job_id not in attempts:  # already terminal: a redelivery; never a second result
                self.w.offsets.ack(a.record.source, a.record.offset)
                continue
            self._start(a, attempts[a.job_id])

    def _start(self, a: Accepted, attempt: int) -> None:
        job = InFlightJob(
            job_id=a.job_id,
            attempt=attempt,
            priority=a.priority,
            request=a.job,
            created_at=_kafka_time(a.record),
            sources=[self._src(a.record)],
            prompt_tokens=len(a.prompt_token_ids),
        )
        deadline = None
        if a.job.timeout_s is not None:
            remaining = (job.created_at + timedelta(seconds=a.job.timeout_s) - utcnow()).total_seconds()
            deadline = time.monotonic() + remaining
        sampling = SamplingParams(
            max_tokens=a.max_tokens,
            temperature=a.job.temperature,
            top_p=a.job.top_p,
            top_k=a.job.top_k,
            seed=a.job.seed,
        )
        self.jobs[a.job_id] = job
        self.streamer.start(a.job_id, attempt)
        self.w.metrics.prompt_tokens.inc(job.prompt_tokens)
        self.w.engine.add_request(
            EngineRequest(
                request_id=a.job_id,
                prompt_token_ids=a.prompt_token_ids,
                sampling=sampling,
                stop=tuple(a.job.stop),
                priority=PRIORITIES[a.priority],
                tenant=a.job.tenant,
                deadline=deadline,
            )
        )

    def _reject(self, r: Rejected) -> None:
        rec = r.record
        headers = [
            ("source_topic", rec.topic.encode()),
            ("source_partition", str(rec.partition).encode()),
            ("source_offset", str(rec.offset).encode()),
            ("error", r.error.encode()),
        ]
        self.w.producer.send(self.topics.dlq, rec.key, rec.value or b"", headers)
        self.w.metrics.rejected.inc()
        log.warning("rejected %s (%s:%d@%d): %s", r.job_id, rec.topic, rec.partition, rec.offset, r.error)
        values = {
            "priority": r.priority,
            "error": r.error,
            "finish_reason": "rejected",
            "created_at": _kafka_time(rec),
            "finished_at": utcnow(),
            "prompt": (rec.value or b"")[:4096].decode("utf-8", "replace"),
            "source_topic": rec.topic,
            "source_partition": rec.partition,
            "source_offset": rec.offset,
            "worker_id": self.w.options.worker_id,
        }

        def write(conn) -> list[JobResult]:
            if not insert_terminal(conn, r.job_id, "rejected", values):
                return []  # that id already has a row: leave it alone
            return [
                JobResult(
                    job_id=r.job_id,
                    status="rejected",
                    priority=r.priority,
                    finish_reason="rejected",
                    error=r.error,
                )
            ]

        self.batch.custom.append((write, [self._src(rec)]))

    # ---- control ---------------------------------------------------------------------------
    def control(self, records: list[Record]) -> None:
        for record in records:
            try:
                cancel = parse_control(record.value, self.w.options.limits)
            except InvalidMessage as exc:
                log.warning("ignored control message at offset %d: %s", record.offset, exc)
                continue
            if cancel.job_id in self.jobs:
                out = self.w.engine.abort_request(cancel.job_id)
                if out is not None:
                    self.on_output(out)
            else:
                self._precancel(cancel.job_id)

    def _precancel(self, job_id: str) -> None:
        """Cancel a job no worker has taken yet: its row becomes terminal, so intake will skip it."""
        values = {
            "priority": "unknown",
            "finish_reason": "abort",
            "finished_at": utcnow(),
            "worker_id": self.w.options.worker_id,
            "error": "cancelled before it started",
        }

        def write(conn) -> list[JobResult]:
            if not insert_terminal(conn, job_id, "cancelled", values):
                return []  # known job: its owner (every worker reads control) cancels it
            return [JobResult(job_id=job_id, status="cancelled", priority="unknown", finish_reason="abort")]

        self.batch.custom.append((write, []))

    # ---- engine outputs --------------------------------------------------------------------
    def on_output(self, out: RequestOutput, step_started: datetime | None = None) -> None:
        """Apply one engine output; `step_started` is when the step that produced it began."""
        job = self.jobs.get(out.request_id)
        if job is None:
            return
        if out.started and job.started_at is None:
            job.started_at = step_started or utcnow()  # first scheduled: when its first step began
            self.batch.running.append((job.job_id, job.started_at))
        if out.new_token_ids or out.text_delta:
            job.on_tokens(len(out.new_token_ids), out.text_delta)
            self.streamer.add(job.job_id, out.text_delta, out.new_token_ids)
            self.w.metrics.generation_tokens.inc(len(out.new_token_ids))
        if out.finish_reason is not None:
            self._conclude(job, out.finish_reason.value, out.detail or None)

    def _conclude(self, job: InFlightJob, finish: str, detail: str | None) -> None:
        del self.jobs[job.job_id]
        row, result = job.conclude(finish, self.w.options.worker_id, error=detail)
        usage = result.usage or Usage(prompt_tokens=0, completion_tokens=0)
        self.streamer.finish(job.job_id, finish, usage)
        self.batch.terminal.append((row, result, job.sources))
        self._observe_result(result)

    def _observe_result(self, result: JobResult) -> None:
        m, t, p = self.w.metrics, result.timings, result.priority
        m.finished.labels(result.status).inc()
        for hist, value in (
            (m.ttft, t.ttft_ms),
            (m.itl, t.mean_itl_ms),
            (m.e2e, t.e2e_ms),
            (m.queue_time, t.queue_ms),
        ):
            if value is not None:
                hist.labels(p).observe(value / 1000)

    # ---- rebalance, flush, shutdown --------------------------------------------------------
    def handle_rebalances(self, events: Iterable[tuple[str, list[tuple[str, int]]]]) -> None:
        for kind, partitions in events:
            if kind != "revoked":
                continue
            revoked = set(partitions)
            for job in [j for j in self.jobs.values() if (j.sources[0][0], j.sources[0][1]) in revoked]:
                self._abort_locally(job.job_id)
            self.w.offsets.forget(revoked)
            log.info("partitions revoked: %s", sorted(revoked))

    def _abort_locally(self, job_id: str) -> None:
        """Stop a job without a terminal row: whoever consumes its message next redoes it (attempt + 1)."""
        self.jobs.pop(job_id, None)
        self.streamer.drop(job_id)
        self.w.engine.abort_request(job_id)

    def abort_all(self) -> None:
        for job_id in list(self.jobs):
            self._abort_locally(job_id)

    def flush(self, force: bool) -> None:
        self.streamer.flush_due(force)
        batch, self.batch = self.batch, WriteBatch()
        self.w.persister.submit(batch)

    def _send_token_event(self, event: TokenEvent) -> None:
        self.w.producer.send(self.topics.tokens, event.job_id, event.model_dump_json().encode())
