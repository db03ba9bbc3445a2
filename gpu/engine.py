"""The Engine: the synchronous engine core (gpu/engine_core.py) plus async scheduling, where step N+1 is
scheduled and launched on a worker thread before step N's tokens are back.

Each Engine.step() call schedules the next step (placeholders for the tokens in flight, via
AsyncScheduler.advance), launches it, then waits for the step before and commits its tokens, so the host's
scheduling and input building overlap the model's work. A failed step and the one launched beside it are
rolled back (their sequences preempted). A subclass of EngineCore that overrides `step`, `has_unfinished`
and `close` (and the scheduler it makes): with async scheduling off it is the core, step for step.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from gpu.engine_core import EngineCore, LiveSequence
from gpu.engine_types import (
    EngineConfig,
    EngineRequest,
    EngineStats,
    RequestOutput,
    StepFailed,
    resolve_async_scheduling,
)
from gpu.model import LoadedModel
from gpu.runner import PreparedStep, SampledTokens
from gpu.step_clock import FORWARD, INPUTS, OUTPUTS, SCHEDULE
from scheduler.async_scheduler import AsyncScheduler, PendingTokens
from scheduler.config import SchedulerConfig
from scheduler.output import SchedulerOutput

__all__ = ["Engine", "EngineConfig", "EngineRequest", "EngineStats", "RequestOutput"]

log = logging.getLogger(__name__)

# While a step thread runs, the engine thread may hold the GIL for a whole switch interval (CPython's
# default 5 ms) before the step thread gets it back to launch or finish a step: far longer than a decode
# step on a GPU. Lowered while any engine's step thread runs, unless the process set its own already.
STEP_THREAD_SWITCH_INTERVAL_S = 0.0001
_DEFAULT_SWITCH_INTERVAL_S = 0.005  # CPython's


class _SwitchInterval:
    """The process's GIL switch interval, lowered while at least one step thread runs, then restored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved = _DEFAULT_SWITCH_INTERVAL_S

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                self._saved = sys.getswitchinterval()
                if self._saved >= _DEFAULT_SWITCH_INTERVAL_S:  # a lower value the process chose stays
                    sys.setswitchinterval(STEP_THREAD_SWITCH_INTERVAL_S)
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                sys.setswitchinterval(self._saved)


_switch_interval = _SwitchInterval()


@dataclass(slots=True)
class InFlightStep:
    """A step launched on the async worker whose tokens the engine has not seen yet."""

    output: SchedulerOutput
    pending: PendingTokens  # where its tokens go (placeholders in the sequences until then)
    started: dict[str, LiveSequence]  # sequences it runs for the first time
    future: Future[SampledTokens]  # its tokens, in its sampling order (on the device once launched)
    launched: float  # perf_counter when it was submitted


class Engine(EngineCore):
    """The engine the worker runs: EngineCore's synchronous steps, or overlapped ones (module docstring)."""

    scheduler: AsyncScheduler

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None) -> None:
        # Async scheduling: one worker thread runs the forward and sampling of each step, in order, while
        # this thread schedules the next one and turns the last one's tokens into outputs.
        self._inflight: InFlightStep | None = None
        self._worker: ThreadPoolExecutor | None = None
        super().__init__(model, config)
        self.set_async_scheduling(resolve_async_scheduling(self.config.async_scheduling, self.runner.device))

    def _new_scheduler(self, config: SchedulerConfig) -> AsyncScheduler:
        return AsyncScheduler(config)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def step(self, only: str | None = None) -> list[RequestOutput]:
        """One iteration: schedule, forward, sample, outputs. `only`: run that request alone (to find
        which one makes steps fail). Raises StepFailed when the forward or sampling raises.

        With async scheduling each call schedules and launches the next step before it waits for the one
        in flight, and returns that one's outputs: the same outputs as synchronous steps, one call later.
        Steps that need the last token before they start (grammars, penalties, logprobs, `only`) run
        synchronously, after the step in flight is finished."""
        if self._inflight is not None and (only is not None or not self._can_overlap()):
            return self._finish_inflight()  # this call finishes the step in flight; the next one runs alone
        if self._worker is not None and only is None and self._can_overlap():
            return self._step_async()
        return super().step(only)

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the last one's tokens are known: not while a
        grammar masks with its matcher's state or penalties count the tokens (both need the last token),
        nor while logprobs are recorded (kept per step in LogitsState), nor while a resumed sample waits for
        its saved tokens to come out (a few steps: its forced token and recomputed logprobs)."""
        return not self._matchers and not self._logits and not self._resumes

    def set_async_scheduling(self, on: bool) -> None:
        """Turn async scheduling on or off (at start, or between runs: benchmarks compare both on one
        engine); turning it off finishes the step in flight, whose outputs are dropped."""
        if on and self._worker is None:
            # The worker's torch ops use as many threads as this one's (a new thread would take the default).
            self._worker = ThreadPoolExecutor(
                1, "inferq-step", initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)
            )
            _switch_interval.acquire()
        elif not on:
            self.close()
        log.info("async scheduling: %s", "on" if self._worker is not None else "off")

    def close(self) -> None:
        """Finish the step in flight (its outputs are dropped) and stop the async worker thread."""
        if self._inflight is not None:
            try:
                self._inflight.future.result().tokens()
            except Exception:  # no one is left to report its failure to; its table updates may be lost
                self.runner.forget_tables()
            self._inflight = None
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
            _switch_interval.release()

    def _step_async(self) -> list[RequestOutput]:
        """Schedule and launch step N+1 (placeholders for the tokens of step N, in flight), then wait for
        step N and return its outputs."""
        self.clock.start()
        self._drop_retired()
        output = self.scheduler.schedule(time.monotonic())
        for seq_id in output.preempted:
            self.runner.release(seq_id)
        self.clock.lap(SCHEDULE)
        previous = self._inflight
        try:
            results = self._launch_and_collect(output, previous)
        except StepFailed as failed:
            failed.outputs.extend(self._finish(ended, (), "") for ended in output.finished)
            raise
        # Ended while scheduling (deadlines): after the outputs of the step before, which they may follow.
        results += [self._finish(ended, (), "") for ended in output.finished]
        self.clock.lap(OUTPUTS)
        return results

    def _launch_and_collect(
        self, output: SchedulerOutput, previous: InFlightStep | None
    ) -> list[RequestOutput]:
        launched = None
        if output.chunks:
            if self.fault_hook is not None:
                try:
                    self.fault_hook(tuple(self._request_ids(output.chunks)))
                except Exception as exc:
                    raise self._failed(output, exc, previous) from exc
            try:
                prepared = self.runner.prepare(
                    output, self._seeds, previous.pending.seq_ids if previous else None
                )
                started = self._newly_started(output)
                assert self._worker is not None
                launched = InFlightStep(
                    output,
                    self.scheduler.advance(output),
                    started,
                    self._worker.submit(self._run_after, prepared, previous.future if previous else None),
                    time.perf_counter(),
                )
            except Exception:  # built but never launched: its table updates never reach the device
                self.runner.forget_tables()
                raise
            self.clock.lap(INPUTS)  # the placeholders and the launch: host work like building the inputs
        self._inflight = launched
        return [] if previous is None else self._collect(previous, launched)

    def _run_after(self, prepared: PreparedStep, before: Future[SampledTokens] | None) -> SampledTokens:
        """On the worker thread: queue the step's forward and sampling, its placeholders filled on the
        device from the tokens of the step before (launched by then: the worker runs steps in order). On
        CUDA this returns before either step is done, so the device runs them back to back."""
        return self.runner.launch(
            prepared, previous=before.result() if before is not None else None, clock=False
        )

    def _collect(self, step: InFlightStep, launched: InFlightStep | None) -> list[RequestOutput]:
        """Wait for a launched step; commit its tokens and make its outputs."""
        self._last_chunks = step.output.chunks
        try:
            tokens = step.future.result().tokens()  # the wait for the device (the GIL released)
        except Exception as exc:
            raise self._failed(step.output, exc, launched, step.started) from exc
        self.clock.lap(FORWARD)  # the wait: what the engine thread could not overlap
        output = step.output
        self._record(len(output.chunks), output.num_tokens, time.perf_counter() - step.launched)
        results: list[RequestOutput] = []
        self._outputs(self.scheduler.commit(step.pending, tokens), step.started, results, True)
        return results

    def _finish_inflight(self) -> list[RequestOutput]:
        """Finish the step in flight without launching another (the next step must run synchronously)."""
        self.clock.start()
        step, self._inflight = self._inflight, None
        assert step is not None
        results = self._collect(step, None)
        self.clock.lap(OUTPUTS)
        return results

    def _failed(
        self,
        output: SchedulerOutput,
        exc: Exception,
        other: InFlightStep | None,
        started: dict[str, LiveSequence] | None = None,
    ) -> StepFailed:
        """A launched step failed: it and the other one launched (after it, or before the one whose launch
        failed) never happened. Their sequences drop their placeholders and are preempted (recomputed when
        readmitted), as the KV of neither step can be trusted; those they started count as not started."""
        self._inflight = None
        if other is not None and not other.future.cancel():  # it runs after the failed one: let it end
            other.future.exception()
        for live in (*(started or {}).values(), *(other.started.values() if other is not None else ())):
            live.started = False
        for chunks in (output.chunks, other.output.chunks if other is not None else ()):
            for seq_id in self.scheduler.rollback(chunks, time.monotonic()):
                self.runner.release(seq_id)
        self._last_chunks = output.chunks
        return StepFailed(self.last_step, [], exc)
