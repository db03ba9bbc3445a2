"""Async scheduling: step N+1 is scheduled and launched on a worker thread before step N's tokens are back.

Each Engine.step() call schedules the next step (placeholders for the tokens in flight, via
Scheduler.advance), launches it, then waits for the step before and commits its tokens, so the host's
scheduling and input building overlap the model's work. A failed step and the one launched beside it are
rolled back (their sequences preempted). A mixin of Engine (gpu/engine.py), which owns the state it uses:
`scheduler`, `runner`, `clock`, `fault_hook`, `_seeds`, `_inflight`, `_worker` and the output helpers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from gpu.engine_types import RequestOutput, StepFailed
from gpu.runner import ModelRunner
from gpu.step_clock import FORWARD, INPUTS, OUTPUTS, SCHEDULE, StepClock
from scheduler.async_scheduler import PendingTokens
from scheduler.output import SchedulerOutput, TokenUpdate
from scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlightStep:
    """A step launched on the async worker whose tokens the engine has not seen yet."""

    output: SchedulerOutput
    pending: PendingTokens  # where its tokens go (placeholders in the sequences until then)
    started: dict[str, Any]  # sequences it runs for the first time (the engine's _Live of each)
    future: Future  # its tokens, in its sampling order
    launched: float  # perf_counter when it was submitted


class AsyncSteps:
    """Engine's overlapped steps (see the module docstring)."""

    scheduler: Scheduler
    runner: ModelRunner
    clock: StepClock
    fault_hook: Callable[[tuple[str, ...]], None] | None
    _seeds: dict[str, int]
    _inflight: InFlightStep | None
    _worker: ThreadPoolExecutor | None
    _last_chunks: tuple
    last_step: tuple[str, ...]
    _drop_retired: Callable[[], None]
    _finish: Callable[..., RequestOutput]
    _newly_started: Callable[[SchedulerOutput], dict[str, Any]]
    _outputs: Callable[[list[TokenUpdate], dict[str, Any], list[RequestOutput], bool], None]
    _record: Callable[[int, int, float], None]
    _request_ids: Callable[[Iterable[Any]], Iterable[str]]

    def set_async_scheduling(self, on: bool) -> None:
        """Turn async scheduling on or off (at start, or between runs: benchmarks compare both on one
        engine); turning it off finishes the step in flight, whose outputs are dropped."""
        if on and self._worker is None:
            # The worker's torch ops use as many threads as this one's (a new thread would take the default).
            self._worker = ThreadPoolExecutor(
                1, "inferq-step", initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)
            )
        elif not on:
            self.close()
        log.info("async scheduling: %s", "on" if self._worker is not None else "off")

    def close(self) -> None:
        """Finish the step in flight (its outputs are dropped) and stop the async worker thread."""
        if self._inflight is not None:
            self._inflight.future.exception()
            self._inflight = None
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

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
            self.clock.lap(INPUTS)  # the placeholders and the launch: host work like building the inputs
        self._inflight = launched
        return [] if previous is None else self._collect(previous, launched)

    def _run_after(self, prepared: Any, before: Future | None) -> list[int]:
        """On the worker thread: the step's forward and sampling, its placeholders filled with the tokens of
        the step before (finished by then: the worker runs steps in order)."""
        return self.runner.run(
            prepared, previous=before.result() if before is not None else None, clock=False
        )

    def _collect(self, step: InFlightStep, launched: InFlightStep | None) -> list[RequestOutput]:
        """Wait for a launched step; commit its tokens and make its outputs."""
        self._last_chunks = step.output.chunks
        try:
            tokens = step.future.result()
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
        started: dict[str, Any] | None = None,
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
