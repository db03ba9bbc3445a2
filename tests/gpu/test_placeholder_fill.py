"""Async scheduling fills step N+1's placeholder tokens from step N's sampled tensor where the model runs
(on CUDA: the device), so step N+1 is launched before step N's tokens reach the host. These tests run
that code path on the CPU: the fill itself, and a runner step whose previous step's tokens are known
only as a tensor (asking for them on the host fails the test)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from gpu.engine import EngineRequest
from gpu.runner import SampledTokens, placeholder_fill
from scheduler.sequence import PLACEHOLDER
from tests.gpu.factories import greedy, make_engine, make_prompts


class DeviceOnly(SampledTokens):
    """A launched step whose tokens have not reached the host: the next step may read only `device`."""

    def tokens(self) -> list[int]:
        raise AssertionError("the next step waited for the previous step's tokens on the host")


def test_the_common_decode_step_takes_the_previous_tokens_in_order() -> None:
    ids = torch.full((3,), PLACEHOLDER, dtype=torch.int64)
    previous = torch.tensor([7, 8, 9])
    fill = placeholder_fill(ids, np.arange(3), np.arange(3), previous)
    assert ids.tolist() == [-1, -2, -3]  # marked on the host: -1 - the token's index
    device_ids = ids.clone()  # what the CUDA step hands the fill: the staged copy
    fill(device_ids)
    assert device_ids.tolist() == [7, 8, 9]


def test_rows_out_of_order_and_real_tokens_between_them() -> None:
    # rows 1 and 4 are the last tokens of two chunks; the other rows are prompt tokens
    ids = torch.tensor([5, PLACEHOLDER, 6, 11, PLACEHOLDER])
    previous = torch.tensor([40, 41, 42])
    fill = placeholder_fill(ids, np.array([1, 4]), np.array([2, 0]), previous)
    device_ids = ids.clone()
    fill(device_ids)
    assert device_ids.tolist() == [5, 42, 6, 11, 40]


def test_a_placeholder_past_the_previous_step_is_refused() -> None:
    ids = torch.tensor([PLACEHOLDER, PLACEHOLDER])
    with pytest.raises(ValueError, match="did not sample"):
        placeholder_fill(ids, np.arange(2), np.array([0, 2]), torch.tensor([1, 2]))


def test_a_step_runs_on_the_previous_steps_device_tokens_alone() -> None:
    """Two overlapped decode steps through the runner, the second filled from the first's tensor, give
    the tokens of two synchronous steps."""
    prompts = make_prompts(3, 5, 9, seed=3)

    def engine_with_decodes():
        engine = make_engine(async_scheduling=False)
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(f"r{i}", prompt, greedy(8)))
        engine.step()  # the prefills (each samples its first token)
        return engine

    sync = engine_with_decodes()
    expected = [[o.new_token_ids[0] for o in sync.step()] for _ in range(2)]

    engine = engine_with_decodes()
    scheduler, runner, seeds = engine.scheduler, engine.runner, engine._seeds
    first = scheduler.schedule(0.0)
    prepared = runner.prepare(first, seeds)
    pending = scheduler.advance(first)
    launched = runner.launch(prepared, clock=False)
    second = scheduler.schedule(0.0)
    assert all(c.token_ids[-1] == PLACEHOLDER for c in second.chunks)  # every row waits on the first step
    prepared = runner.prepare(second, seeds, pending.seq_ids)
    after = runner.launch(prepared, previous=DeviceOnly(launched.device), clock=False)
    assert [launched.tokens(), after.tokens()] == expected


def test_the_switch_interval_is_lowered_while_a_step_thread_runs(monkeypatch) -> None:
    """The engine thread must not hold the GIL for CPython's 5 ms while the step thread waits to launch."""
    import gpu.engine
    from gpu.engine import STEP_THREAD_SWITCH_INTERVAL_S, _SwitchInterval

    original = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        interval = _SwitchInterval()
        interval.acquire()
        interval.acquire()  # a second engine
        assert sys.getswitchinterval() == pytest.approx(STEP_THREAD_SWITCH_INTERVAL_S)
        interval.release()
        assert sys.getswitchinterval() == pytest.approx(STEP_THREAD_SWITCH_INTERVAL_S)
        interval.release()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        sys.setswitchinterval(0.001)  # the process's own choice (the worker's setting) stays
        interval.acquire()
        assert sys.getswitchinterval() == pytest.approx(0.001)
        interval.release()
        # An async engine, counted by a fresh process-wide counter: async engines other tests left open
        # hold the real one, and would leave nothing to lower.
        sys.setswitchinterval(0.005)
        fresh = _SwitchInterval()
        monkeypatch.setattr(gpu.engine, "_switch_interval", fresh)
        engine = make_engine(async_scheduling=True)
        assert fresh._users == 1
        assert sys.getswitchinterval() == pytest.approx(STEP_THREAD_SWITCH_INTERVAL_S)
        engine.close()
        assert fresh._users == 0 and sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(original)
