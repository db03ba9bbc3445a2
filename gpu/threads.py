"""Choose, by measurement, how many intra-op threads the forward uses: all the caller's, or one.

Measured on this project's shared 2-core machine: while other processes compete for the cores, OpenMP
barriers across 2 threads stall whenever one thread is descheduled, and the many small operations of a
decode step ran 5-20x slower than on one thread; on a quiet machine 2 threads are faster. So the runner
keeps timing both: a probe alternates the settings for a few steps and keeps the one with the lower time
per unit of work. Probes are spaced further apart while the choice holds, since a probe of the losing
setting costs time, and come at once when steps turn much slower than the probe measured (the load changed).
"""

from __future__ import annotations

import statistics

import torch

MIN_PERIOD, MAX_PERIOD = 32, 512  # steps between probes
PROBES_PER_SETTING = 2
CLEAR_WIN = 2.0  # after one pair of probes, a setting this much faster wins at once
SLOWDOWN = 3.0  # between probes, two steps this much slower than the chosen setting's probes: probe again


class ThreadTuner:
    def __init__(self) -> None:
        self.period = MIN_PERIOD
        self._plan: list[int] = []  # settings still to probe, in order
        self._samples: dict[int, list[float]] = {}
        self._chosen: int | None = None  # between probes; None until the first probe ends
        self._steps_since_probe = MIN_PERIOD  # probe on the first steps
        self._current = 1
        self._restore: int | None = None
        self._baseline = 0.0  # the chosen setting's median seconds per unit in the last probe
        self._slow_steps = 0

    @property
    def chosen(self) -> int | None:
        return self._chosen

    def before_step(self) -> None:
        """Set the thread count for the coming step (the caller's setting comes back in after_step)."""
        caller = torch.get_num_threads()
        if caller <= 1:
            self._current = caller
            return
        if not self._plan and self._steps_since_probe >= self.period:
            self._plan = [caller, 1] * PROBES_PER_SETTING
            self._samples = {caller: [], 1: []}
            self._steps_since_probe = 0
        self._current = self._plan[0] if self._plan else (self._chosen or caller)
        if self._current != caller:
            self._restore = caller
            torch.set_num_threads(self._current)

    def after_step(self, seconds: float, work: float) -> None:
        """Report the step's time and its work (any measure proportional to its compute)."""
        if self._restore is not None:
            torch.set_num_threads(self._restore)
            self._restore = None
        per_unit = seconds / max(work, 1e-9)
        if not self._plan:
            self._steps_since_probe += 1
            self._watch(per_unit)
            return
        self._plan.pop(0)
        self._samples[self._current].append(per_unit)
        if all(self._samples.values()):
            ranked = sorted(self._samples, key=lambda n: statistics.median(self._samples[n]))
            best, other = (statistics.median(self._samples[n]) for n in ranked)
            if not self._plan or other > CLEAR_WIN * best:
                self._decide(ranked[0], best)

    def _watch(self, per_unit: float) -> None:
        if self._chosen is None:
            return
        self._slow_steps = self._slow_steps + 1 if per_unit > SLOWDOWN * self._baseline else 0
        if self._slow_steps >= 2:
            self._steps_since_probe = self.period = MIN_PERIOD
            self._slow_steps = 0

    def _decide(self, threads: int, per_unit: float) -> None:
        self._plan = []
        self.period = min(self.period * 2, MAX_PERIOD) if threads == self._chosen else MIN_PERIOD
        self._chosen = threads
        self._baseline = per_unit
