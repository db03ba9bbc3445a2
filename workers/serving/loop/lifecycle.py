"""Per-job bookkeeping of the worker: intake, admission outcomes, cancels, streaming, conclusion, revocation.

Everything here runs on the engine loop's thread and never touches PostgreSQL except through the
admitter (synchronous, guarded) and write items handed to the persister (asynchronous).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Protocol

from gpu.engine import Engine, EngineRequest, RequestOutput
from gpu.engine_process import EngineProcess
from gpu.engine_types import ResumeRefused
from scheduler.types import Priority
from schemas.job_key import JobKey
from schemas.jobs import TokenEvent
from schemas.topics import Topics
from schemas.validation import Limits
from workers.clock import utcnow
from workers.db import Engine as Database
from workers.db.jobs import Admitted, Terminal
from workers.kafka_io import Partition, Record
from workers.serving.admission import cancels
from workers.serving.admission.admitter import Admitter, Decision
from workers.serving.admission.models import ServedModels
from workers.serving.admission.thread import AdmissionThread
from workers.serving.errors import describe_error
from workers.serving.intake.rejected import Rejected
from workers.serving.intake.sampling import sampling_params
from workers.serving.intake.validation import Accepted
from workers.serving.loop import resumption
from workers.serving.loop.choices import REQUEST_ENDS, LogprobFormatter
from workers.serving.loop.inflight import InFlightJob
from workers.serving.loop.job_log import job_event
from workers.serving.loop.progress import SAVE_INTERVAL_S, ProgressSaver
from workers.serving.metrics import WorkerMetrics
from workers.serving.offsets import OffsetTracker
from workers.serving.outbox.delivery import Waitable
from workers.serving.outbox.writes import (
    CancelRequested,
    Concluded,
    Progress,
    Republish,
    Running,
    WriteItem,
    storable,
)
from workers.serving.streaming.stream import TokenStreamer

log = logging.getLogger(__name__)

RECHECK_S = 5.0  # how often a copy another worker runs is decided again
PRIORITIES = {"high": Priority.HIGH, "normal": Priority.NORMAL, "low": Priority.LOW}


class Owner(Protocol):
    """What knows the partitions this worker owns now (the intake thread: its consumer's assignment)."""

    @property
    def assignment(self) -> AbstractSet[Partition]: ...


class JobLifecycle:
    """Every job of this worker from its record to its terminal row; what it needs is handed in."""

    def __init__(
        self,
        engine: Engine | EngineProcess,
        topics: Topics,
        *,
        worker_id: str,
        limits: Limits,
        coalesce_s: float,
        database: Database,
        ready: threading.Event,
        offsets: OffsetTracker,
        owner: Owner,
        metrics: WorkerMetrics,
        write: Callable[[list[WriteItem]], None],
        send_event: Callable[[TokenEvent, str], Waitable | None],
        save_interval_s: float = SAVE_INTERVAL_S,
        models: ServedModels | None = None,
    ) -> None:
        self.engine, self.topics, self.worker_id, self.limits = engine, topics, worker_id, limits
        self.offsets, self.metrics = offsets, metrics
        self.owner = owner  # knows the partitions this worker owns now
        self.write = write  # hands row writes to the persister
        self.jobs: dict[str, InFlightJob] = {}  # by the engine's request id (JobKey.request_id)
        self.logprob_format = LogprobFormatter(engine.tokenizer)  # the engine thread's tokenizer
        self.admitter = AdmissionThread(Admitter(database, worker_id, models), self._is_held, ready)
        self.recent_cancels = cancels.RecentCancels()
        self.streamer = TokenStreamer(send_event, coalesce_s, self.logprob_format.entries)
        self.items: list[WriteItem] = []
        self.saver = ProgressSaver(engine.fingerprint, save_interval_s)  # running jobs' tokens, saved
        self._recheck: list[tuple[float, Accepted]] = []  # superseded copies, by when to decide them again

    # ---- intake ----------------------------------------------------------------------------
    def intake(self, prepared: list[tuple[Record, Accepted | Rejected | None]]) -> None:
        accepted = []
        for record, decision in prepared:
            self.offsets.track(record.source, record.offset, record.last_offset)  # a bad batch: its range
            if decision is None:
                self._guarded_control_record(record)
                continue
            if isinstance(decision, Rejected):
                self._reject(decision)
            else:
                accepted.append(decision)
        self.admitter.add(accepted)

    def admit_pending(self) -> None:
        if self._recheck and self._recheck[0][0] <= time.monotonic():
            now = time.monotonic()
            due = [a for at, a in self._recheck if at <= now]
            self._recheck = [(at, a) for at, a in self._recheck if at > now]
            self.admitter.add([a for a in due if a.record.source in self.owner.assignment])
        decisions, rejected = self.admitter.results()
        owned = self.owner.assignment  # decided after a revocation: the new owner reads them again
        for r in rejected:
            if r.record.source in owned:
                self._reject(r)
        try:
            for d in decisions:
                if d.accepted.record.source in owned:
                    self._guarded_settle(d)
        finally:
            self.admitter.settled(decisions)

    def _is_held(self, a: Accepted) -> bool:
        return a.request_id in self.jobs

    def _guarded_settle(self, d: Decision) -> None:
        """Settle one decision; a failure is this job's alone: it ends `failed`, the others go on."""
        try:
            self._settle(d)
        except Exception as exc:  # noqa: BLE001 - one record must never stop the worker or its partition
            a = d.accepted
            log.exception("job %s: its admission could not be settled", a.job_id)
            detail = f"admission failed: {describe_error(exc)}"
            if a.request_id in self.jobs:
                self.fail(a.request_id, detail)
            else:
                terminal = _ended_before_start(a, self.worker_id, "failed", "error", detail)
                self.items.append(Concluded(terminal, (a.record.coordinates,)))
                self.metrics.observe_finished("failed", "error")

    def _settle(self, d: Decision) -> None:
        a, outcome = d.accepted, d.outcome
        source = a.record.coordinates
        running = self.jobs.get(a.request_id)
        if outcome.kind in ("held", "start") and running is not None:
            self._carried_again(running, a, outcome)
        elif outcome.kind == "held":
            # the copy it was held for has ended here (or never started): this record is decided afresh
            self.admitter.add([a])
        elif outcome.kind == "superseded":
            # another worker runs the job for a later group generation: this copy is decided again once
            # that run has ended (then `done`), and meanwhile holds its offset
            self._recheck.append((time.monotonic() + RECHECK_S, a))
        elif outcome.kind == "done":  # a redelivery: never a second run, a result only if none went out
            if outcome.published:
                self.offsets.ack(a.record.source, a.record.offset)
            else:
                self.items.append(Republish(a.job_id, (source,), a.tenant))
        elif outcome.kind == "cancelled" or a.key in self.recent_cancels:
            why = "cancelled before it started"
            ended = _ended_before_start(a, self.worker_id, "cancelled", "abort", why)
            self.items.append(Concluded(ended, (source,)))
            self.metrics.observe_finished("cancelled", "abort")
            job_event("finished", a.job_id, a.priority, status="cancelled", finish_reason="abort")
        else:
            self._start(a, outcome)

    def _carried_again(self, job: InFlightJob, a: Accepted, outcome: Admitted) -> None:
        """Another copy of a job this worker runs: one run, and the copy is acked with it."""
        job.sources.append(a.record.coordinates)
        if outcome.kind == "start" and outcome.attempt > job.attempt:
            # the copy re-queued the row as a later attempt: this run is that attempt now, or the
            # attempt fence would refuse its writes and the row would stay queued
            log.warning("job %s: a copy re-queued it as attempt %d while attempt %d ran here",
                        a.job_id, outcome.attempt, job.attempt)  # fmt: skip
            job.attempt = outcome.attempt
            if job.started_at is not None:
                self.items.append(Running(job.job_id, job.started_at, job.attempt, tenant=a.tenant))

    def _start(self, a: Accepted, outcome: Admitted) -> None:
        attempt, created_at = outcome.attempt, a.record.posted_at(utcnow())
        job = InFlightJob(
            job_id=a.job_id,
            attempt=attempt,
            priority=a.priority,
            request=a.job,
            created_at=created_at,
            sources=[a.record.coordinates],
            prompt_tokens=len(a.prompt_token_ids),
            logprob_format=self.logprob_format,
            tool_dialect=a.tool_dialect,
            lora_name=a.lora.name if a.lora is not None else "",
        )
        deadline = None
        if a.job.timeout_s is not None:
            remaining = (created_at + timedelta(seconds=a.job.timeout_s) - utcnow()).total_seconds()
            deadline = time.monotonic() + remaining
        sampling = sampling_params(a.job, a.max_tokens, self.engine)
        if outcome.seed is not None:  # the seed stored with the job: every attempt samples alike
            sampling = replace(sampling, seed=outcome.seed)
        resume = resumption.plan(
            attempt, outcome.progress, a.job.n, self.saver.fingerprint, not sampling.greedy, sampling.seed
        )
        job.progress.saved = outcome.progress is not None  # its rows go with the job's terminal row
        self.jobs[a.request_id] = job
        self.metrics.observe_admitted(job.prompt_tokens)
        job.engine_request = EngineRequest(
            request_id=a.request_id,
            prompt_token_ids=a.prompt_token_ids,
            sampling=sampling,  # max_tokens counts the tokens resumed: the engine counts them as generated
            stop=tuple(a.job.stop),
            priority=PRIORITIES[a.priority],
            tenant=a.job.tenant,
            deadline=deadline,
            n=a.job.n,
            grammar=a.grammar,
            resume=resume.tokens,
            lora=a.lora,
        )
        job_event("admitted", a.job_id, a.priority, tenant=a.tenant, attempt=attempt,
                  prompt_tokens=job.prompt_tokens, max_tokens=a.max_tokens)  # fmt: skip
        if not resume.resumes:
            self._add(job, restart=resume.restart, saved=resume.saved, detail=resume.detail)
            return
        try:
            self._add(job)
        except ResumeRefused as exc:  # raised by add_request, in- or out-of-process: from scratch, then
            self._add(job, restart=resumption.REFUSED, saved=resume.saved, detail=describe_error(exc))

    def _add(self, job: InFlightJob, restart: str | None = None, saved: int = 0, detail: str = "") -> None:
        """Hand the job to the engine: resuming as planned, or (`restart`: why) from scratch."""
        request = job.engine_request
        assert request is not None
        if restart is not None:
            request = job.engine_request = replace(request, resume=())
            self.metrics.observe_restarted(restart, saved)
            log.info("job %s: attempt %d starts from scratch (%s): %s", job.job_id, job.attempt, restart,
                     detail)  # fmt: skip
            job_event("restarted", job.job_id, job.priority, attempt=job.attempt, reason=restart,
                      saved_tokens=saved, detail=detail)  # fmt: skip
        if job.request.stream:  # a job that is not streamed has no token events, only its result
            # a later attempt that does not resume starts the output over, and its events say so
            restarted = job.attempt > 1 and not any(request.resume)
            self.streamer.start(request.request_id, job.attempt, job.request.tenant, job.job_id, restarted)
        self.engine.add_request(request)

    def _reject(self, r: Rejected) -> None:
        self.metrics.rejected.labels(r.reason).inc()
        rec = r.record
        job_event("rejected", r.job_id, r.priority, tenant=r.tenant, reason=r.reason, error=r.error,
                  topic=rec.topic, partition=rec.partition, offset=rec.offset)  # fmt: skip
        self.items.append(r)

    # ---- cancels ---------------------------------------------------------------------------
    def _guarded_control_record(self, record: Record) -> None:
        try:
            self._control_record(record)
        except Exception as exc:  # noqa: BLE001 - a control record that breaks is dead-lettered, not fatal
            log.exception("control record %s:%d@%d failed", record.topic, record.partition, record.offset)
            error = f"could not be processed: {describe_error(exc)}"
            self._reject(Rejected(record, "", "default", "control", error, "error", False, False))

    def _control_record(self, record: Record) -> None:
        """A control record this worker owns in the group: record the cancel durably (then ack)."""
        cancel = cancels.parse(record, self.limits, self.topics)
        if isinstance(cancel, str):  # why it is refused
            tenant = self.topics.tenant_of(record.topic) or "default"
            self._reject(Rejected(record, "", tenant, "control", cancel, "invalid_control", False, False))
            return
        at = record.posted_at(utcnow())
        self.items.append(CancelRequested(cancel.job_id, cancel.tenant, at, (record.coordinates,)))
        key = JobKey(cancel.tenant, cancel.job_id)
        self.recent_cancels.add(key)  # its job may be in this very poll
        self.cancel(key)

    def broadcast(self, records: list[Record]) -> None:
        """Control records every worker reads: remember them, abort the job if it runs here."""
        for record in records:
            try:
                cancel = cancels.parse(record, self.limits, self.topics)
                if not isinstance(cancel, str):
                    key = JobKey(cancel.tenant, cancel.job_id)
                    self.recent_cancels.add(key)
                    self.cancel(key)
            except Exception:  # noqa: BLE001 - the group's reader of this record handles it durably
                log.exception("broadcast control record %s:%d@%d failed", *record.coordinates)

    def cancel(self, key: JobKey) -> None:
        """Abort this job if it runs here."""
        request_id = key.request_id
        if request_id not in self.jobs:
            return
        for out in self.engine.abort_request(request_id):  # one per live sample
            self.on_output(out)

    # ---- engine outputs --------------------------------------------------------------------
    def on_output(self, out: RequestOutput, step_started: datetime | None = None) -> None:
        """Apply one engine output; `step_started` is when the step that produced it began."""
        job = self.jobs.get(out.request_id)
        if job is None:
            return
        if out.started and job.started_at is None:
            job.started_at = step_started or utcnow()  # first scheduled: when its first step began
            self.items.append(Running(job.job_id, job.started_at, job.attempt, tenant=job.request.tenant))
            job_event("started", job.job_id, job.priority, attempt=job.attempt,
                      queue_ms=_ms_between(job.created_at, job.started_at))  # fmt: skip
        if out.resumed and out.new_token_ids:
            self._resumed(job, out)
        elif out.new_token_ids or out.text_delta:
            text = storable(out.text_delta)  # a model can emit U+0000; stream and row carry the same text
            first = job.first_token_mono is None and bool(out.new_token_ids)
            logprobs = out.logprobs if job.choices.with_logprobs else None
            calls = None
            if job.choices.parses_tools:  # the text outside calls, and pieces of calls
                parsed = job.choices.parse(out.index, text)
                text, calls = parsed.content, parsed.tool_calls
            gap_s = job.on_tokens(len(out.new_token_ids), text, out.index, out.logprobs)
            job.progress.add(out.index, out.new_token_ids, text)
            if job.request.stream:
                self.streamer.add(out.request_id, text, out.new_token_ids, out.index, logprobs, calls)
            self.metrics.observe_tokens(job.priority, len(out.new_token_ids), gap_s)
            if first:
                job_event("first_token", job.job_id, job.priority, attempt=job.attempt,
                          ttft_ms=_ms_between(job.created_at, job.first_token_at))  # fmt: skip
        if out.finish_reason is None:
            return
        if job.choices.parses_tools:
            self._end_tool_calls(job, out)
        if out.index == 0:  # the prompt's cache hits, once a job (its other samples share its blocks)
            job.cached_tokens = out.cached_tokens
        if finish := job.on_end(out.index, out.finish_reason.value):
            self._conclude(job, finish, out.detail or None)
            if finish in REQUEST_ENDS:  # one sample ended the job (a grammar's dead end): stop the others
                self.engine.abort_request(out.request_id)  # their outputs find no job: dropped
        else:  # the job goes on: this sample's last token event, with its own reason
            reason = job.choices.samples[out.index].finish_reason or out.finish_reason.value
            self.streamer.end_sample(out.request_id, out.index, reason)
            job.progress.end(out.index, reason)  # saved with its last tokens

    def _resumed(self, job: InFlightJob, out: RequestOutput) -> None:
        """A resumed sample's saved tokens, out once (gpu/resume.py): its output so far, generated by an
        earlier attempt and saved already; its stream restates it from offset 0, apart."""
        text = storable(out.text_delta)
        calls = None
        if job.choices.parses_tools:
            # the parser's state rebuilt from the output so far (its calls, what it holds back): what
            # follows parses as in an uninterrupted run, and the restatement has its content and calls
            parsed = job.choices.parse(out.index, text)
            text, calls = parsed.content, parsed.tool_calls
        job.on_resumed(out.index, len(out.new_token_ids), text, out.logprobs)
        job.progress.resume(out.index, len(out.new_token_ids))
        if job.request.stream:
            logprobs = out.logprobs if job.choices.with_logprobs else None
            self.streamer.restate(out.request_id, out.index, text, out.new_token_ids, logprobs, calls)
        if len(job.resumed) == 1:  # the attempt's first resumed sample
            request = job.engine_request
            saved = sum(len(t) for t in request.resume) if request is not None else len(out.new_token_ids)
            self.metrics.observe_resumed(saved)
            job_event("resumed", job.job_id, job.priority, attempt=job.attempt, resumed_tokens=saved)

    def _end_tool_calls(self, job: InFlightJob, out: RequestOutput) -> None:
        """What the tool-call parser held back of the sample that ended, decided now: to its text and its
        stream, before its last event."""
        rest = job.choices.parse_end(out.index)
        if rest.content or rest.tool_calls:
            job.on_tokens(0, rest.content, out.index)
            if job.request.stream:
                logprobs = [] if job.choices.with_logprobs else None
                self.streamer.add(out.request_id, rest.content, (), out.index, logprobs, rest.tool_calls)

    def _conclude(self, job: InFlightJob, finish: str, detail: str | None) -> None:
        request_id = job.key.request_id
        del self.jobs[request_id]
        row, timings = job.conclude(finish, self.worker_id, error=detail)
        reasons = {sample.index: sample.finish_reason for sample in job.choices.samples}
        stream_end = self.streamer.finish(request_id, finish, job.usage, reasons)
        # a later attempt's terminal row also takes any rows a superseded one saved after its admission
        progress = job.progress.saved or job.attempt > 1
        self.items.append(Concluded(row, tuple(job.sources), stream_end, progress=progress))
        self.metrics.observe_job(row.status, finish, job.priority, timings, job.lora_name)
        # (fields by name, not model_dump: this runs once a job, on the thread every job waits on)
        job_event("finished", job.job_id, job.priority, status=row.status, finish_reason=finish,
                  attempt=job.attempt, prompt_tokens=job.prompt_tokens,
                  completion_tokens=job.completion_tokens, queue_ms=timings.queue_ms, ttft_ms=timings.ttft_ms,
                  mean_itl_ms=timings.mean_itl_ms, e2e_ms=timings.e2e_ms, error=detail)  # fmt: skip

    # below, a job is named by its engine request id (JobKey.request_id), as engine outputs name it
    def hold(self, request_id: str) -> None:
        """Take a job out of the engine (its KV freed) without ending it: a suspect of failing steps, kept
        until it is convicted (`fail`) or the worker gives up (no row: redone elsewhere)."""
        if request_id in self.jobs:
            self.engine.abort_request(request_id)  # its abort output is not the job's end: dropped

    def prompt_of(self, request_id: str) -> str:
        job = self.jobs.get(request_id)
        return (job.request.prompt or "") if job is not None else ""

    def fail(self, request_id: str, detail: str) -> None:
        """End a job `failed` (finish reason `error`) with `detail`: terminal row and result, offset acked."""
        job = self.jobs.get(request_id)
        if job is None:
            return
        try:
            self.engine.abort_request(request_id)  # frees its KV blocks; its own output is not wanted now
        except Exception:  # noqa: BLE001
            log.exception("job %s: the engine could not abort it", request_id)
        try:
            self._conclude(job, "error", detail)
        except Exception:  # noqa: BLE001 - no terminal row then: the job is redone after a redelivery
            log.exception("job %s: could not be concluded; left for redelivery", request_id)
            self._abort_locally(request_id)

    # ---- rebalance, flush, shutdown --------------------------------------------------------
    def revoke(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Let go of this worker's jobs of partitions it no longer owns: their new owner resumes them from
        the progress saved here (a save that lands after its admission is fenced out)."""
        revoked = set(partitions)
        self.hand_over([r for r, job in self.jobs.items() if job.sources[0][:2] in revoked])
        self.admitter.drop(revoked)

    def hand_over(self, request_ids: Iterable[str]) -> int:
        """Save these jobs' progress (queued for the persister) and stop them without a terminal row, for
        the group to resume elsewhere (attempt + 1); how many there were."""
        jobs = [self.jobs[r] for r in request_ids if r in self.jobs]
        chunks = self.saver.collect(jobs, time.monotonic(), force=True)
        if chunks:
            self.items.append(Progress(tuple(chunks)))
        for job in jobs:
            self._abort_locally(job.key.request_id)
        return len(jobs)

    def _abort_locally(self, request_id: str) -> None:
        """Stop a job without a terminal row: whoever consumes its message next redoes it (attempt + 1)."""
        self.jobs.pop(request_id, None)
        self.streamer.drop(request_id)
        self.engine.abort_request(request_id)

    def abort_all(self) -> int:
        """Let go of every job (progress saved): the group resumes them. How many there were."""
        return self.hand_over(list(self.jobs))

    def flush(self, force: bool) -> None:
        self.streamer.flush_due(force)
        now = time.monotonic()
        if self.saver.due(now) and (chunks := self.saver.collect(self.jobs.values(), now)):
            self.items.append(Progress(tuple(chunks)))
        items, self.items = self.items, []
        self.write(items)


def _ms_between(earlier: datetime, later: datetime | None) -> float | None:
    return None if later is None else max(0.0, (later - earlier).total_seconds() * 1000)


def _ended_before_start(a: Accepted, worker_id: str, status: str, finish_reason: str, error: str) -> Terminal:
    values = {"finish_reason": finish_reason, "error": error, "worker_id": worker_id}
    values |= {"finished_at": utcnow(), "completion_tokens": 0}
    return Terminal(a.job_id, status, values, tenant=a.tenant)
