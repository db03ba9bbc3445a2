"""`bench.host_overhead` at a tiny size: the engine decodes every row under the stub, greedy and sampled;
the JSON shape."""

from __future__ import annotations

import json

import pytest

from bench.host_overhead.command import main
from gpu.step_clock import PHASES

ARGV = ["--batch-sizes", "2,3", "--prompt-len", "20", "--steps", "3", "--reps", "2", "--warmup", "1"]


@pytest.mark.usefixtures("keep_threads")
def test_host_overhead_decodes_every_row_of_both_workloads_and_writes_the_result(tmp_path, capsys):
    path = tmp_path / "host.json"
    assert main([*ARGV, "--json", str(path)]) == 0
    payload = json.loads(path.read_text())
    assert payload["workloads"] == ["greedy", "sampled"]
    for workload in ("greedy", "sampled"):
        assert set(payload["host_ms_per_step"][workload]) == {"2", "3"}
        assert all(ms > 0 for ms in payload["host_ms_per_step"][workload].values())
        assert all(set(phases) == set(PHASES) for phases in payload["phases"][workload].values())
        assert payload["decode_steps"][workload] == {"2": 6, "3": 6}
        assert payload["tokens"][workload] == {"2": 12, "3": 18}
    # a sampled step's sampler works (temperature, filters, penalties); a greedy one's takes one argmax
    assert payload["sampler_ops"]["sampled"]["3"] > 2 * payload["sampler_ops"]["greedy"]["3"] > 0
    assert set(payload["sampled_minus_greedy_ms"]) == {"2", "3"}
    # Prefill steps, op counts, the warm-up and the timed steps all ran the (stub) forward.
    assert payload["forward_calls"] >= 2 * 2 * (6 + 1 + 1 + 1)
    out = capsys.readouterr().out
    assert "us/row" in out and "sampled - greedy" in out
    # The eager steps' launches: the Triton kernels' steps launch fewer operators per layer than torch's.
    launches = {(r["step"], r["kernels"]): r["per_layer"] for r in payload["launches"]}
    assert set(launches) == {(s, k) for s in ("prefill", "mixed") for k in ("torch", "triton")}
    assert launches["prefill", "triton"] < launches["prefill", "torch"]
    assert launches["mixed", "triton"] < launches["mixed", "torch"]
    assert launches["prefill", "triton"] == 9  # 4 matmuls, 2 add+RMSNorms, RoPE+cache, attention, SiLU*up


@pytest.mark.usefixtures("keep_threads")
def test_host_overhead_with_async_scheduling(tmp_path):
    # The stub runs on the engine's worker thread, a step ahead: every timed step still returns every row.
    path = tmp_path / "host.json"
    argv = [*ARGV[:1], "3", *ARGV[2:], "--workloads", "greedy"]
    assert main([*argv, "--async-scheduling", "--no-launches", "--json", str(path)]) == 0
    payload = json.loads(path.read_text())
    assert payload["tokens"] == {"greedy": {"3": 18}} and payload["phases"]["greedy"]["3"]["sample"] == 0
    assert payload["host_ms_without_argmax"] == payload["host_ms_per_step"]


@pytest.mark.usefixtures("keep_threads")
def test_host_overhead_with_the_argmax_on_the_device(tmp_path, monkeypatch):
    # The stub stands in for the CUDA step and returns each row's argmax: the engine never runs one itself,
    # and the sampler's tensor work is the device's, left out of the host's time.
    import gpu.sampler

    calls, argmax = [], gpu.sampler.fast_argmax
    counted = lambda logits: calls.append(len(logits)) or argmax(logits)  # noqa: E731
    monkeypatch.setattr(gpu.sampler, "fast_argmax", counted)
    path = tmp_path / "host.json"
    assert main([*ARGV, "--device-argmax", "--no-launches", "--json", str(path)]) == 0
    payload = json.loads(path.read_text())
    assert payload["tokens"]["sampled"] == {"2": 12, "3": 18}
    assert payload["host_ms_without_argmax"] == payload["host_ms_per_step"]
    # only the bench's own argmax timing (20 runs per workload and batch size)
    assert sorted(set(calls)) == [2, 3] and len(calls) == 2 * 2 * 20
    for workload in ("greedy", "sampled"):
        phases, host = payload["phases"][workload], payload["host_ms_per_step"][workload]
        for batch in ("2", "3"):
            whole = sum(phases[batch].values()) - phases[batch]["forward"]
            assert host[batch] < whole  # the sampler's time is not the host's
    # As on CUDA, a decode step sends the device its block table's updates: at most a new block a row,
    # against the step's own rows up to its widest context (what a step sent before)
    for batch in ("2", "3"):
        sent, rows = (payload[key]["greedy"][batch] for key in ("table_update_bytes", "table_rows_bytes"))
        assert sent < 16 * int(batch) <= rows  # rows of 2 blocks and more (20-token prompts, 16 a block)
