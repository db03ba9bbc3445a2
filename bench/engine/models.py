"""Loading the HF model the Hugging Face contenders run (the same weights the engine loads)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def load_hf_model(path: str | None, seed: int = 0) -> torch.nn.Module:
    """A fresh fp32 CPU model in eval mode with SDPA attention; `path` is a model spec, as the engine takes.

    Each contender gets its own instance: transformers' batching manager switches the attention implementation
    of the model it runs, and the engine may repack weights, so no instance is shared between contenders.
    """
    from gpu.model import load_model

    model = load_model(path, "float32", "cpu", seed=seed).model
    model.set_attn_implementation("sdpa")
    return model.eval()
