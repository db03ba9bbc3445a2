"""The GGUF cache: one entry per file digest, never a half-written one."""

from __future__ import annotations

import os
import time

import pytest

from gpu.gguf_cache import cached_checkpoint, file_digest
from gpu.model_source import DEFAULT_MODEL, resolve_model


def test_a_failed_conversion_leaves_no_entry_and_no_temporary(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 4)  # a header and then nonsense
    cache = tmp_path / "cache"
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises, nothing is published
        cached_checkpoint(broken, cache)
    assert list((cache / "models").iterdir()) == []


def test_temporaries_left_by_a_crash_are_removed_once_stale(tmp_path):
    root = tmp_path / "cache" / "models"
    stale, fresh = root / ".tmp-crashed", root / ".tmp-converting-now"
    for d in (stale, fresh):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"half")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    with pytest.raises(Exception):  # noqa: B017
        cached_checkpoint(broken, tmp_path / "cache")
    assert sorted(p.name for p in root.iterdir()) == [".tmp-converting-now"]


@pytest.mark.slow
def test_the_entry_is_named_by_the_digest_and_reused(smollm2, settings):
    gguf = resolve_model(DEFAULT_MODEL).path
    start = time.perf_counter()
    entry = cached_checkpoint(gguf, settings.cache_dir)  # the fixture's load converted it already
    assert time.perf_counter() - start < 5  # hashing only: no second conversion
    assert entry.name == f"gguf-{file_digest(gguf)}"
    assert {p.name for p in entry.iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert "quantization_config" not in (entry / "config.json").read_text()


def test_a_conversion_reports_its_stages_and_a_cached_entry_none(tmp_path):
    stages = []
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(Exception):  # noqa: B017 - the reader fails in the first stage, after reporting it
        cached_checkpoint(broken, tmp_path / "cache", lambda *stage: stages.append(stage))
    assert stages == [("reading the tokenizer", 1, 3)]
    stages.clear()
    (tmp_path / "cache" / "models" / f"gguf-{file_digest(broken)}").mkdir()  # as if converted before
    cached_checkpoint(broken, tmp_path / "cache", lambda *stage: stages.append(stage))
    assert stages == []
