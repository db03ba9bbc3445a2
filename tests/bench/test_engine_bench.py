"""`bench engine` end to end on a tiny workload: every contender runs and the result file has the keys."""

from __future__ import annotations

import json

import pytest

from bench.engine.summary import REQUIRED_KEYS
from workers.cli import build_parser


@pytest.mark.slow
def test_bench_engine_runs_every_contender(tmp_path, capsys):
    path = tmp_path / "engine.json"
    argv = [
        "bench",
        "engine",
        "--model",
        "tiny",
        "--json",
        str(path),
        "--requests",
        "3",
        "--prompt-len",
        "4:9",
    ]
    argv += ["--output-len", "2:5", "--reps", "1", "--no-step-time"]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    payload = json.loads(path.read_text())
    assert set(REQUIRED_KEYS) <= payload.keys()
    assert all(payload[key] is not None for key in REQUIRED_KEYS)
    assert payload["correctness"]["length_errors"] == {"static": [], "hf_cb": [], "inferq": []}
    assert payload["correctness"]["greedy_vs_static"]["inferq"]["compared"] == 3
    assert "inferq" in capsys.readouterr().out
