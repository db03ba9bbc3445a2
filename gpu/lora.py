"""LoRA adapters for the engine (the loader and batched forward come with the engine's LoRA work)."""

from __future__ import annotations

from pathlib import Path

from gpu.engine_types import LoraRequest


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the cause."""


def check_lora(lora: LoraRequest) -> None:
    """Raises LoraError for an adapter whose directory is missing (the engine's loader checks the rest)."""
    if not Path(lora.path).is_dir():
        raise LoraError(f"adapter {lora.name!r}: {lora.path} is not a directory")
