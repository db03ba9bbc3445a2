"""bench/device/bench.py's report of a run whose phases were cut short by bench/device_check.sh's timeouts.
(The driver itself is dry-run on the CPU by `DEVICE=cpu TINY=1 bash bench/device_check.sh`.)"""

from __future__ import annotations

import json

from bench.device import bench as device_bench


def test_summary_tables_show_missing_phases_as_dashes(tmp_path):
    full = {
        "shape": "llama-1.1b-shape",
        "startup_s": 12.5,
        "cuda_step": {
            "kernels": "decode=triton",
            "graphs": 17,
            "trials": [
                {"name": "decode", "chosen": True, "triton_ms": 0.02, "torch_ms": 0.09, "reason": "faster"},
                {"name": "varlen", "chosen": False, "triton_ms": None, "torch_ms": None, "reason": "bad|x"},
            ],
        },
        "inferq": {"requests": 256, "tok_s": 31000.0},
        "inferq_async": {"requests": 256, "tok_s": 34000.0},
        "hf_cb": {"requests": 64, "tok_s": 1000.0},
        "x_hf_cb": 31.0,
        "decode_steps": {
            "64": {"step_ms": 1.4, "kernel_us_per_step": 1200.0, "launches_per_step": 300.0,
                   "gpu_busy_fraction": 0.857, "graph_span_fraction": 0.9,
                   "profile": [{"name": "gemm", "us_per_step": 800.0, "calls_per_step": 88.0}]},
            "256": {"step_ms": 2.9},
        },
    }  # fmt: skip
    cut = {"shape": "llama-3-8b-shape", "startup_s": 30.0}  # timed out after start-up
    paths = [tmp_path / "a.json", tmp_path / "b.json", tmp_path / "never-written.json"]
    paths[0].write_text(json.dumps(full))
    paths[1].write_text(json.dumps(cut))
    lines = device_bench.summarize(paths).splitlines()
    assert lines[0].endswith("| step ms @64 | step ms @256 |")
    row = "| llama-1.1b-shape | 12.5 | 17 | 31,000 (256) | 34,000 | 1,000 (64) | 31.0 | 1.40 | 2.90 |"
    assert lines[2] == row
    assert lines[3] == "| llama-3-8b-shape | 30.0 | - | - (-) | - | - (-) | - | - | - |"
    assert "| llama-1.1b-shape | 64 | 1.40 | 1,200 | 300 | 86% | 90% |" in lines
    assert "| varlen | torch | - | - | bad/x |" in lines  # a '|' would break the table
    assert "| 800.0 | 88.0 | `gemm` |" in lines


def test_a_failed_phase_is_recorded_and_costs_only_its_own_row(tmp_path):
    """A phase that never ran on a GPU (async scheduling) fails: the error is in the JSON and the summary,
    and the phases after it still run."""
    report = device_bench.Report(tmp_path / "s.json", shape="smollm2-135m-shape")
    with device_bench._phase(report, "inferq_async"):
        raise RuntimeError("CUDA error: an illegal memory access")
    ran_after = []
    with device_bench._phase(report, "decode_steps_64"):
        ran_after.append(True)
    saved = json.loads((tmp_path / "s.json").read_text())
    assert ran_after and saved["errors"] == {
        "inferq_async": "RuntimeError: CUDA error: an illegal memory access"
    }
    summary = device_bench.summarize([tmp_path / "s.json"])
    assert "phase inferq_async FAILED: RuntimeError: CUDA error" in summary
