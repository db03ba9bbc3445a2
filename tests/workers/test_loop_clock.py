"""The loop clock charges each phase its time and keeps idle waiting apart from busy time."""

from __future__ import annotations

from workers.serving.loop import clock as loop_clock
from workers.serving.loop.clock import LoopClock


def test_idle_is_kept_apart_from_the_busy_shares(monkeypatch):
    now = iter([0.0, 0.0, 2.0, 2.25, 3.0])
    monkeypatch.setattr(loop_clock.time, "perf_counter", lambda: next(now))
    clock = LoopClock()
    clock.start()
    clock.lap("idle")  # 2 s waiting for records
    clock.lap("intake")  # 0.25 s
    clock.lap("step")  # 0.75 s
    assert clock.seconds["idle"] == 2.0
    assert clock.summary() == "step 0.8s (75%), intake 0.2s (25%); idle 2.0s"
