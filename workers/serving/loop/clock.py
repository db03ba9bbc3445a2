"""Where the engine loop's time goes: cumulative seconds per phase of an iteration.

Kept in plain floats (two perf_counter reads a phase), published to the metrics once a second: `bench e2e`
reads them to say what the worker spends outside `engine.step()`.
"""

from __future__ import annotations

import time

# idle: waiting for records with nothing to run (kept apart, so the other phases add up to busy time)
PHASES = ("rebalance", "idle", "intake", "admission", "control", "step", "outputs", "flush", "commit", "flow")


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
        busy = {name: s for name, s in self.seconds.items() if name != "idle"}
        total = sum(busy.values()) or 1.0
        parts = sorted(busy.items(), key=lambda kv: -kv[1])
        shares = ", ".join(f"{name} {s:.1f}s ({s / total:.0%})" for name, s in parts if s >= 0.05)
        return f"{shares}; idle {self.seconds['idle']:.1f}s"


def thread_seconds() -> dict[str, float]:
    """The calling thread's CPU seconds and, on Linux, its seconds runnable but waiting for a core.

    Read on the engine loop's thread: busy loop time beyond the two is time blocked (mostly on the GIL,
    which other threads hold while the loop's torch operations have released it)."""
    out = {"cpu": time.thread_time()}
    try:
        with open("/proc/thread-self/schedstat") as f:
            out["runqueue"] = int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    return out
