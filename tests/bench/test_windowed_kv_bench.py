"""`bench.engine.windowed_kv` at a tiny size: the windowed model holds far fewer KV blocks for the same
sequences."""

from __future__ import annotations

import json

from bench.engine.windowed_kv import main


def test_a_windowed_model_holds_fewer_blocks_for_the_same_sequences(tmp_path, capsys):
    path = tmp_path / "w.json"
    args = [
        "--window",
        "16",
        "--sequences",
        "2",
        "--prompt-len",
        "120",
        "--max-tokens",
        "8",
        "--json",
        str(path),
    ]
    main(args)
    results = json.loads(path.read_text())["results"]
    full, windowed = results["no window"], results["window 16"]
    assert full["peak_kv_blocks"] == 2 * -(-(120 + 8 - 1) // 16) and full["kv_window"] is None
    assert windowed["kv_window"] == 16 and windowed["peak_kv_blocks"] < full["peak_kv_blocks"] // 2
    assert "window 16" in capsys.readouterr().out
