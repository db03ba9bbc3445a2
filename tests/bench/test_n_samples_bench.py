"""`bench.engine.n_samples` at a tiny size: the n-sample request computes its prompt once and holds fewer
blocks."""

from __future__ import annotations

import json

from bench.engine.n_samples import main


def test_one_request_with_n_samples_computes_the_prompt_once(tmp_path, capsys):
    path = tmp_path / "n.json"
    main(["--n", "3", "--prompt-len", "64", "--max-tokens", "4", "--json", str(path)])
    results = json.loads(path.read_text())["results"]
    separate, forked = results["n separate, no prefix cache"], results["one request, n=3"]
    assert separate["prompt_tokens_computed"] == 3 * 64
    # the prompt once, then each other sample's tail (at most a block of 16 tokens) itself
    assert 64 < forked["prompt_tokens_computed"] <= 64 + 2 * 16
    assert forked["peak_kv_blocks"] < separate["peak_kv_blocks"]
    assert "one request, n=3" in capsys.readouterr().out
