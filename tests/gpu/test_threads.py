"""The thread tuner keeps the faster setting, restores the caller's setting, and re-probes."""

from __future__ import annotations

import pytest
import torch

from gpu.threads import MIN_PERIOD, ThreadTuner


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def drive(tuner: ThreadTuner, cost: dict[int, float], steps: int) -> list[int]:
    """Run steps whose time per token depends on the thread count in force; the counts used."""
    used = []
    for _ in range(steps):
        tuner.before_step()
        used.append(torch.get_num_threads())
        tuner.after_step(cost[torch.get_num_threads()] * 10, 10)
        assert torch.get_num_threads() == 2  # the caller's setting is back after every step
    return used


@pytest.mark.parametrize(
    "cost, winner", [({2: 1.0, 1: 1.4}, 2), ({2: 9.0, 1: 1.0}, 1)], ids=["quiet", "busy"]
)
def test_keeps_the_faster_setting(two_threads, cost, winner):
    tuner = ThreadTuner()
    used = drive(tuner, cost, 40)
    assert tuner.chosen == winner
    assert used[:2] == [2, 1]  # probing alternates the two settings
    assert used[10:30] == [winner] * 20


def test_clear_win_ends_probe_early_and_probes_grow_sparser(two_threads):
    tuner = ThreadTuner()
    used = drive(tuner, {2: 9.0, 1: 1.0}, 2)
    assert used == [2, 1] and tuner.chosen == 1
    drive(tuner, {2: 9.0, 1: 1.0}, MIN_PERIOD + 2)
    assert tuner.period == 2 * MIN_PERIOD  # same choice again: next probe later


def test_switches_when_conditions_change(two_threads):
    tuner = ThreadTuner()
    drive(tuner, {2: 9.0, 1: 1.0}, 10)
    assert tuner.chosen == 1
    drive(tuner, {2: 1.0, 1: 1.5}, 4 * MIN_PERIOD)
    assert tuner.chosen == 2


def test_single_threaded_caller_is_left_alone():
    tuner = ThreadTuner()
    torch.set_num_threads(1)
    tuner.before_step()
    tuner.after_step(1.0, 1)
    assert tuner.chosen is None and torch.get_num_threads() == 1


def test_slowdown_between_probes_triggers_a_new_probe(two_threads):
    tuner = ThreadTuner()
    drive(tuner, {2: 1.0, 1: 1.5}, 4 * MIN_PERIOD)
    assert tuner.chosen == 2 and tuner.period > MIN_PERIOD
    used = drive(tuner, {2: 9.0, 1: 1.5}, 6)  # the machine got busy: 2 threads now stall
    assert 1 in used and tuner.chosen == 1
