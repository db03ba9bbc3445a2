"""Where an engine step's wall time goes, by phase, cumulative over the engine's life.

Each phase ends with a lap: one perf_counter call that charges the time since the previous lap to that
phase. The phases of a step therefore add up to the whole step, and the clock is cheap enough (about a
microsecond a step) to stay on in production.
"""

from __future__ import annotations

import time

SCHEDULE = "schedule"  # the scheduler picks the step's chunks (and the engine drops ended sequences)
INPUTS = "inputs"  # the step's flat input tensors and attention metadata
FORWARD = "forward"  # the model (on CUDA: launching it; the wait for it lands in the sample phase)
SAMPLE = "sample"  # sampling settings, the draw, and the copy of the tokens back to Python
OUTPUTS = "outputs"  # the scheduler's bookkeeping, detokenizing and the step's RequestOutputs
# With async scheduling the forward and sampling run on the engine's worker thread: FORWARD is then the
# engine thread's wait for the step in flight, and SAMPLE is not timed (it overlaps the host phases).
PHASES = (SCHEDULE, INPUTS, FORWARD, SAMPLE, OUTPUTS)


class StepClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._mark = time.perf_counter()

    def start(self) -> None:
        """A step begins: time from here on is charged to its phases."""
        self.steps += 1
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """The phase just ended: charge it the time since the previous lap (or the step's start)."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._mark
        self._mark = now

    def snapshot(self) -> dict[str, float]:
        """Seconds per phase so far; subtract two snapshots for an interval."""
        return dict(self.seconds)
