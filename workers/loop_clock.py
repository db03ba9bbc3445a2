"""Where the engine loop's time goes: cumulative seconds per phase of an iteration.

Kept in plain floats (two perf_counter reads a phase), published to the metrics once a second: `bench e2e`
reads them to say what the worker spends outside `engine.step()`.
"""

from __future__ import annotations

import time

PHASES = ("rebalance", "intake", "admission", "control", "step", "outputs", "flush", "commit", "flow")


class LoopClock:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the last lap (or start) to `phase`."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def summary(self) -> str:
        total = sum(self.seconds.values()) or 1.0
        parts = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{name} {s:.1f}s ({s / total:.0%})" for name, s in parts if s >= 0.05)
