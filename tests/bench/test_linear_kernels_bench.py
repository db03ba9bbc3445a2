"""`python -m bench.engine.linear_kernels` on the tiny model: every weight shape and row count is timed."""

from __future__ import annotations

import json

from bench.engine import linear_kernels


def test_linear_kernel_bench_times_every_shape_and_row_count(tmp_path, capsys):
    path = tmp_path / "linear.json"
    assert linear_kernels.main(["--model", "tiny", "--rows", "1,8", "--reps", "1", "--json", str(path)]) == 0
    payload = json.loads(path.read_text())
    shapes = {tuple(r["shape"]) for r in payload["results"]}
    assert shapes == {(512, 256), (256, 256), (1376, 256), (256, 688), (32000, 256)}
    for row in payload["results"]:
        assert row["rows"] in (1, 8) and "plain" in row["seconds"]
        assert row["chosen"] in row["seconds"]
    assert "panel / best other" in capsys.readouterr().out
