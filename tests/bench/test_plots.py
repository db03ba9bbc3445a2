"""The benchmark figures: what they are drawn from, and that a real PNG is written (no display)."""

from __future__ import annotations

import pytest

from bench.e2e.report import figure, latency_groups
from bench.e2e.stats import per_job
from bench.engine.summary import summarize
from bench.plots import engine_figure, png_path, write_or_explain
from tests.bench.conftest import make_raw, make_result
from tests.bench.test_e2e_helpers import trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
pytest.importorskip("matplotlib")


def test_per_job_lists_every_measurable_job():
    traces = [trace(0.0, (0.1, 1), (0.3, 2), usage=3), trace(1.0, (1.3, 4), usage=4)]
    assert per_job(traces) == {"ttft_ms": pytest.approx([100.0, 300.0]), "itl_ms": pytest.approx([100.0])}


def test_latency_groups_pool_poisson_rates_and_split_priorities():
    payload = {
        "poisson": [
            {"per_job": {"ttft_ms": [1.0], "itl_ms": [2.0]}},
            {"per_job": {"ttft_ms": [3.0], "itl_ms": []}},
        ],
        "priority_load": {
            "high_idle_per_job": {"ttft_ms": [5.0], "itl_ms": [6.0]},
            "high_per_job": {"ttft_ms": [7.0], "itl_ms": [8.0]},
            "low_per_job": {"ttft_ms": [], "itl_ms": []},  # nothing measured: no group
        },
    }
    groups = latency_groups(payload)
    assert list(groups) == ["normal\n(poisson)", "high\n(idle worker)", "high\n(behind low)"]
    assert groups["normal\n(poisson)"] == {"ttft_ms": [1.0, 3.0], "itl_ms": [2.0]}


def test_engine_figure_is_a_png(tmp_path, requests):
    runs = {name: [make_result(requests, wall), make_result(requests, wall * 1.1)] for name, wall in
            (("static", 4.0), ("hf_cb", 2.0), ("inferq", 1.0))}  # fmt: skip
    payload = summarize(make_raw(requests, runs, flops_per_s=[1e9, 1e9]), {}, None)
    payload["inferq"]["step_time"] = {"16": {"step_ms": 5.0}, "64": {"step_ms": 12.0}}
    path = engine_figure(payload, png_path(tmp_path / "engine.json"))
    assert path.name == "engine.png" and path.read_bytes().startswith(PNG_MAGIC)


def test_e2e_figure_is_a_png(tmp_path):
    payload = {
        "poisson": [{"per_job": {"ttft_ms": [10.0, 20.0], "itl_ms": [3.0, 4.0]}}],
        "e2e_vs_engine": 0.9,
    }
    path = figure(payload, tmp_path / "e2e.png")
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_a_failed_figure_import_is_reported_not_raised():
    def needs_missing_module(*_args):
        raise ImportError("No module named 'matplotlib'")

    assert "figure skipped" in write_or_explain(needs_missing_module)
