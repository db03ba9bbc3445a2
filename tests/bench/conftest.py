"""Factories for the bench tests: workloads and fake contender results (no model runs, no timing)."""

from __future__ import annotations

import pytest
import torch

from bench.engine.contenders import RunResult
from bench.engine.flops import ModelShape
from bench.engine.summary import EngineBenchRaw
from bench.workload import BenchRequest, WorkloadSpec, make_workload


@pytest.fixture
def keep_threads(monkeypatch):
    """Benches set torch threads and OMP_NUM_THREADS for their process: the session gets its own back."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def make_requests(requests: int = 6, seed: int = 0, vocab_size: int = 1000) -> tuple[BenchRequest, ...]:
    return make_workload(WorkloadSpec(requests, (4, 12), (2, 9), seed), vocab_size)


def make_result(
    requests: tuple[BenchRequest, ...], wall_s: float, short: tuple[str, ...] = (), extras: dict | None = None
) -> RunResult:
    """Every request gets tokens 0..n-1, except those in `short`, which get one token less."""
    tokens = {r.request_id: list(range(r.max_new_tokens - (r.request_id in short))) for r in requests}
    return RunResult(wall_s=wall_s, cpu_s=2 * wall_s, tokens=tokens, extras=extras or {})


def make_raw(
    requests: tuple[BenchRequest, ...], runs: dict[str, list[RunResult]], flops_per_s=()
) -> EngineBenchRaw:
    shape = ModelShape(body_linear_params=1000, num_layers=2, attn_dim=16, lm_head_params=5000)
    return EngineBenchRaw(
        spec=WorkloadSpec(len(requests)),
        requests=requests,
        shape=shape,
        workload_flops=10**9,
        runs=runs,
        flops_per_s=list(flops_per_s),
    )


@pytest.fixture
def requests() -> tuple[BenchRequest, ...]:
    return make_requests()
