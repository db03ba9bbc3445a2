"""What the GPU machine's image lacks of this project's Python dependencies, and a way to pretend to be it.

The device machine (/work/.library/device/KINDS.md, ../shared/notes/gpu-h200.md) has no network: what its
image lacks is either carried as wheels by bench/device_check.sh (CARRIED) or must not be needed by the
device tests (a test needing one skips with its reason). `block()` makes every module in LACKS
unimportable in this process, so CI can collect and start the device check's test list as the image would
(bench/device/simulated_image/sitecustomize.py calls it when INFERQ_SIMULATE_IMAGE=1).
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from pathlib import Path

# Each dependency in pyproject.toml (runtime and dev) -> its top-level import name, or None where the image
# has it (KINDS.md's package list, read 2026-11-17). tests/bench/test_device_check.py fails on a dependency
# missing here, so a new one gets a decision.
DEPENDENCIES: dict[str, str | None] = {
    "torch": None,
    "transformers": None,  # 5.17 on the image; 5.24 carried
    "celery": "celery",
    "kafka-python": "kafka",
    "sqlalchemy": "sqlalchemy",
    "psycopg2-binary": "psycopg2",
    "alembic": "alembic",
    "pydantic": "pydantic",
    "prometheus-client": None,
    "psutil": None,
    "crc32c": "crc32c",
    "python-snappy": "snappy",
    "lz4": "lz4",
    "zstandard": "zstandard",
    "gguf": "gguf",
    "accelerate": None,
    "rich": None,
    "xgrammar": "xgrammar",
    # the HTTP API (workers/api/): no device test imports it
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "httptools": "httptools",
    "uvloop": None,
    "python-multipart": "multipart",
    "pytest": None,
    "hypothesis": None,
    "ruff": "ruff",
    "pytest-timeout": None,
    "jsonschema": "jsonschema",
    "pyyaml": None,
    "matplotlib": None,
    "confluent-kafka": "confluent_kafka",
    "openai": "openai",
    "peft": None,
    "cupy-cuda13x": None,
}
# Carried as wheels (bench/device/carry.sh downloads exactly these into .whl; device_check.sh installs them):
# transformers 5.24 (the image has 5.17) and the regex it pins; structured outputs on CUDA
# (tests/gpu/test_grammar_cuda.py): xgrammar and its needs, jsonschema and its needs. About 22 MB.
CARRIED = (
    "transformers==5.24.0",
    "regex==2026.11.19",
    "xgrammar==0.2.9",
    "apache-tvm-ffi==0.1.15.post2",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
)
# The image's Triton (torch 2.11's): the kernels are written to its language, and tests/gpu/test_triton_aot.py
# compiles them with this version, installed beside the venv by dev.sh (the venv's own is torch's, newer).
TRITON = "3.6.0"


def pinned_triton() -> Path:
    """Where dev.sh installs the image's Triton (`pip install --target`), for the AOT compile test."""
    default = Path.home() / ".cache" / "inferq" / f"triton-{TRITON}"
    return Path(os.environ.get("INFERQ_DEVICE_TRITON", default))


# The simulation is the bare image, carried wheels left out: a device test that cannot run without one of
# them must skip with its reason (a device call made without `bash bench/device/carry.sh` still runs).
LACKS = frozenset(name for name in DEPENDENCIES.values() if name is not None) | {"pydantic_core"}


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201
        if fullname.partition(".")[0] in LACKS:
            raise ModuleNotFoundError(f"No module named {fullname!r} (simulated GPU image)", name=fullname)
        return None


def block() -> None:
    """Make the image's missing packages unimportable from now on in this process (idempotent)."""
    if not any(isinstance(finder, _Blocker) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Blocker())


def simulating() -> bool:
    return os.environ.get("INFERQ_SIMULATE_IMAGE") == "1"


if __name__ == "__main__":  # the carry set, one requirement a line (bench/device/carry.sh reads it)
    print("\n".join(CARRIED))
