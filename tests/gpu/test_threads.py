"""The thread tuner times the same forward at each setting, keeps the faster, restores the caller's
setting after every step, probes only small steps, and probes again when steps turn slow."""

from __future__ import annotations

import pytest
import torch

from gpu.cpu import threads
from gpu.cpu.threads import MIN_PERIOD, ThreadTuner


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(threads.time, "perf_counter", fake)
    return fake


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def drive(tuner: ThreadTuner, clock: FakeClock, cost: dict[int, float], steps: int, tokens: int = 10):
    """Steps whose forward costs cost[threads] per token; (threads of each step's output, runs per step)."""
    used, calls = [], []
    for _ in range(steps):
        tuner.before_step()
        start, ran = clock.now, []

        def forward(ran: list[int] = ran) -> int:
            n = torch.get_num_threads()
            ran.append(n)
            clock.now += cost[n] * tokens
            return n

        out = tuner.forward(forward, tokens, tokens)
        assert out == ran[-1]  # the output of the last run is the step's
        tuner.after_step(clock.now - start, tokens)
        assert torch.get_num_threads() == 2  # the caller's setting is back after every step
        used.append(ran[-1])
        calls.append(len(ran))
    return used, calls


@pytest.mark.parametrize(
    "cost, winner, probes", [({2: 1.0, 1: 1.4}, 2, 1), ({2: 9.0, 1: 1.0}, 1, 2)], ids=["quiet", "busy"]
)
def test_keeps_the_faster_setting(two_threads, clock, cost, winner, probes):
    tuner = ThreadTuner()
    used, calls = drive(tuner, clock, cost, 20)
    # a probe runs the same forward twice; leaving the caller's setting takes two probes in a row
    assert calls[:probes] == [2] * probes and calls[probes:] == [1] * (20 - probes)
    assert tuner.chosen == winner
    assert used[probes:] == [winner] * (20 - probes)


def test_one_noisy_probe_does_not_change_the_setting(two_threads, clock):
    tuner = ThreadTuner()
    drive(tuner, clock, {2: 1.0, 1: 2.0}, 1)
    assert tuner.chosen == 2
    tuner._steps_since_probe = tuner.period  # the next step probes, during a neighbour's burst
    used, calls = drive(tuner, clock, {2: 9.0, 1: 2.0}, 1)
    assert calls == [2] and tuner.chosen == 2 and used == [2]
    used, calls = drive(tuner, clock, {2: 1.0, 1: 2.0}, 1)  # the burst is over: the confirmation fails
    assert calls == [2] and tuner.chosen == 2


def test_one_thread_must_win_clearly(two_threads, clock):
    tuner = ThreadTuner()
    drive(tuner, clock, {2: 1.0, 1: 0.95}, 3)  # within noise: the caller's setting stays
    assert tuner.chosen == 2


def test_large_steps_are_never_probed(two_threads, clock):
    tuner = ThreadTuner(max_probe_tokens=64)
    _, calls = drive(tuner, clock, {2: 1.0, 1: 2.0}, 5, tokens=1024)
    assert calls == [1] * 5 and tuner.chosen is None
    _, calls = drive(tuner, clock, {2: 1.0, 1: 2.0}, 1, tokens=32)
    assert calls == [2] and tuner.chosen == 2


def test_probes_grow_sparser_while_the_choice_holds(two_threads, clock):
    tuner = ThreadTuner()
    drive(tuner, clock, {2: 1.0, 1: 2.0}, MIN_PERIOD + 2)
    assert tuner.period == 2 * MIN_PERIOD  # the same choice twice: the next probe comes later


def test_switches_when_conditions_change(two_threads, clock):
    tuner = ThreadTuner()
    drive(tuner, clock, {2: 9.0, 1: 1.0}, 10)
    assert tuner.chosen == 1
    drive(tuner, clock, {2: 1.0, 1: 1.5}, 2 * MIN_PERIOD)
    assert tuner.chosen == 2


def test_single_threaded_caller_is_left_alone(clock):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tuner = ThreadTuner()
        tuner.before_step()
        assert tuner.forward(lambda: "out", 1, 1.0) == "out"
        tuner.after_step(1.0, 1)
        assert tuner.chosen is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_slowdown_between_probes_triggers_a_new_probe(two_threads, clock):
    tuner = ThreadTuner()
    drive(tuner, clock, {2: 1.0, 1: 1.5}, 4 * MIN_PERIOD)
    assert tuner.chosen == 2 and tuner.period > MIN_PERIOD
    used, calls = drive(tuner, clock, {2: 9.0, 1: 1.5}, 5)  # the machine got busy: 2 threads now stall
    assert 2 in calls and tuner.chosen == 1 and used[-1] == 1
