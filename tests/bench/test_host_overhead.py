"""`bench.host_overhead` at a tiny size: the engine decodes every row under the stub; the JSON shape."""

from __future__ import annotations

import json

import pytest

from bench.host_overhead.command import main
from gpu.step_clock import PHASES


@pytest.mark.usefixtures("keep_threads")
def test_host_overhead_decodes_every_row_and_writes_the_result(tmp_path, capsys):
    path = tmp_path / "host.json"
    argv = ["--batch-sizes", "2,3", "--prompt-len", "20", "--steps", "3", "--reps", "2", "--warmup", "1"]
    assert main([*argv, "--json", str(path)]) == 0
    payload = json.loads(path.read_text())
    assert set(payload["host_ms_per_step"]) == {"2", "3"}
    # The eager steps' launches: the Triton kernels' steps launch fewer operators per layer than torch's.
    launches = {(r["step"], r["kernels"]): r["per_layer"] for r in payload["launches"]}
    assert set(launches) == {(s, k) for s in ("prefill", "mixed") for k in ("torch", "triton")}
    assert launches["prefill", "triton"] < launches["prefill", "torch"]
    assert launches["mixed", "triton"] < launches["mixed", "torch"]
    assert launches["prefill", "triton"] == 9  # 4 matmuls, 2 add+RMSNorms, RoPE+cache, attention, SiLU*up
    assert all(ms > 0 for ms in payload["host_ms_per_step"].values())
    assert all(set(phases) == set(PHASES) for phases in payload["phases"].values())
    assert payload["decode_steps"] == {"2": 6, "3": 6}
    assert payload["tokens"] == {"2": 12, "3": 18}
    # Prefill steps, the warm-up and the timed steps all ran the (stub) forward.
    assert payload["forward_calls"] >= 2 * (6 + 1 + 1)
    assert "us/row" in capsys.readouterr().out


@pytest.mark.usefixtures("keep_threads")
def test_host_overhead_with_async_scheduling(tmp_path):
    # The stub runs on the engine's worker thread, a step ahead: every timed step still returns every row.
    path = tmp_path / "host.json"
    argv = ["--batch-sizes", "3", "--prompt-len", "20", "--steps", "3", "--reps", "2", "--warmup", "1"]
    assert main([*argv, "--async-scheduling", "--no-launches", "--json", str(path)]) == 0
    payload = json.loads(path.read_text())
    assert payload["tokens"] == {"3": 18} and payload["phases"]["3"]["sample"] == 0  # sampled on the worker
    assert payload["host_ms_without_argmax"] == payload["host_ms_per_step"]


@pytest.mark.usefixtures("keep_threads")
def test_host_overhead_with_the_argmax_on_the_device(tmp_path, monkeypatch):
    # The stub stands in for the CUDA step and returns each row's argmax: the engine never runs one itself.
    import gpu.sampler

    calls, argmax = [], gpu.sampler.fast_argmax
    counted = lambda logits: calls.append(len(logits)) or argmax(logits)  # noqa: E731
    monkeypatch.setattr(gpu.sampler, "fast_argmax", counted)
    path = tmp_path / "host.json"
    argv = ["--batch-sizes", "2,3", "--prompt-len", "20", "--steps", "3", "--reps", "2", "--warmup", "1"]
    assert main([*argv, "--device-argmax", "--no-launches", "--json", str(path)]) == 0
    payload = json.loads(path.read_text())
    assert payload["tokens"] == {"2": 12, "3": 18}
    assert payload["host_ms_without_argmax"] == payload["host_ms_per_step"]
    assert sorted(set(calls)) == [2, 3] and len(calls) == 2 * 20  # only the bench's own argmax timing
