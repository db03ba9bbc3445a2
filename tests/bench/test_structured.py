"""`bench.engine.structured` at a tiny size: both runs make the same tokens, the schema jobs end by their
grammar."""

from __future__ import annotations

import json

import pytest

from bench.engine.structured import main


@pytest.mark.usefixtures("keep_threads")
def test_structured_runs_both_batches_on_the_same_tokens(tmp_path, capsys):
    path = tmp_path / "structured.json"
    argv = ["--requests", "4", "--reps", "1", "--free-len", "6", "--prompt-len", "4:8", "--threads", "1"]
    assert main([*argv, "--json", str(path)]) == 0
    payload = json.loads(path.read_text())
    assert payload["constrained_jobs"] == 2
    assert payload["same_tokens"] and payload["constrained_stopped"]
    assert set(payload["summary"]) == {"constrained", "free"}
    assert payload["summary"]["free"]["tokens"] == payload["summary"]["constrained"]["tokens"]
    assert "overhead of the constrained run" in capsys.readouterr().out
