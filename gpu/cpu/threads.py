"""Choose, by measurement, how many intra-op threads the forward uses: all the caller's, or one.

Measured on this project's shared 2-core machine: while other processes compete for the cores, OpenMP
barriers across 2 threads stall whenever one thread is descheduled, and the many small operations of a
decode step ran 5-20x slower than on one thread; on a quiet machine 2 threads are about twice as fast.

A probe runs one step's forward twice, once per setting, and keeps the faster (a change of setting must
win two probes in a row). Running the same forward again is harmless (it writes the same K/V to the same
slots and returns the same logits) and makes the comparison exact: an earlier design compared different
steps per unit of work, and a prefill step's better efficiency made one thread look faster on a quiet
machine, costing 40% of SmolLM2's throughput.
Probes use small steps only (a decode batch), so each costs about one extra step at the slower setting;
they are spaced further apart while the choice holds, and come sooner when steps turn much slower than
the probe measured (the load changed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

MIN_PERIOD, MAX_PERIOD = 32, 512  # steps between probes
ONE_THREAD_MARGIN = 0.85  # one thread must take under this share of the caller's time to be chosen
SLOWDOWN = 3.0  # between probes, two steps this much slower per unit of work than the probe: probe again

T = TypeVar("T")


def _timed(threads: int, run: Callable[[], T]) -> tuple[T, float]:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    out = run()
    return out, time.perf_counter() - start


class ThreadTuner:
    def __init__(self, max_probe_tokens: int = 64) -> None:
        self.max_probe_tokens = max_probe_tokens
        self.period = MIN_PERIOD
        self._chosen: int | None = None  # None until the first probe
        self._steps_since_probe = MIN_PERIOD  # probe on the first eligible step
        self._restore: int | None = None
        self._baseline = 0.0  # seconds per unit of work of the chosen setting in the last probe
        self._slow_steps = 0
        self._candidate: int | None = None  # a setting one probe preferred, awaiting confirmation
        self._probed = False  # this step was a probe: its time is not a normal step's

    @property
    def chosen(self) -> int | None:
        return self._chosen

    def before_step(self) -> None:
        """Set the chosen thread count for the coming step (the caller's setting is back after_step)."""
        caller = torch.get_num_threads()
        self._probed = False
        if caller > 1 and self._chosen is not None and self._chosen != caller:
            self._restore = caller
            torch.set_num_threads(self._chosen)

    def forward(self, run: Callable[[], T], tokens: int, work: float) -> T:
        """Run the step's forward: twice, timed at each setting, when a probe is due and the step is small."""
        caller = self._restore if self._restore is not None else torch.get_num_threads()
        due = self._steps_since_probe >= self.period and tokens <= self.max_probe_tokens
        if caller <= 1 or not due:
            return run()
        _, one = _timed(1, run)
        out, all_threads = _timed(caller, run)  # second: any cache warmed by the first favours the default
        best = 1 if one < ONE_THREAD_MARGIN * all_threads else caller
        current = self._chosen or caller
        self._steps_since_probe = 0
        if best != current and self._candidate != best:
            # One sample can be a neighbour's burst: a change needs the next probe (the next small step) too.
            self._candidate = best
            self._steps_since_probe = self.period
        else:
            self._candidate = None
            self.period = min(self.period * 2, MAX_PERIOD) if best == self._chosen else MIN_PERIOD
            self._chosen = best
            self._baseline = (one if best == 1 else all_threads) / max(work, 1e-9)
        chosen = self._chosen or caller
        torch.set_num_threads(chosen)  # for the rest of the step; after_step restores the caller's
        self._restore = caller if chosen != caller else None
        self._probed = True
        return out

    def after_step(self, seconds: float, work: float) -> None:
        """Report the step's time and its work (any measure proportional to its compute)."""
        if self._restore is not None:
            torch.set_num_threads(self._restore)
            self._restore = None
        if self._probed or self._chosen is None:
            return
        self._steps_since_probe += 1
        slow = seconds / max(work, 1e-9) > SLOWDOWN * self._baseline
        self._slow_steps = self._slow_steps + 1 if slow else 0
        if self._slow_steps >= 2:
            self._steps_since_probe = self.period = MIN_PERIOD
            self._slow_steps = 0
