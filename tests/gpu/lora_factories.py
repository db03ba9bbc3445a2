"""PEFT adapters made in the test, and the HF + PEFT reference model for each (the LoRA gold tests)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from gpu.engine_types import EngineRequest, LoraRequest
from gpu.model import LoadedModel
from tests.gpu.factories import greedy

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    model: LoadedModel,
    directory: Path,
    name: str,
    seed: int,
    r: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] = LLAMA_TARGETS,
    **config: Any,
) -> tuple[LoraRequest, LoadedModel]:
    """A LoRA adapter of `model` with random A and non-zero random B, saved as PEFT saves one; returns
    its request and the HF + PEFT model (a copy of `model`'s weights) that is its reference."""
    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(model.model)
    lora_config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **config
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(base, lora_config)
        for name_, param in peft_model.named_parameters():
            if "lora_B" in name_:  # PEFT draws B like any linear: keep it large enough to change outputs
                param.data = torch.randn_like(param) * 0.2
    path = directory / name
    peft_model.save_pretrained(path)
    peft_model.eval()
    reference = LoadedModel(peft_model, model.config, model.tokenizer, model.device, model.dtype)
    return LoraRequest(name, str(path)), reference


def lora_requests(
    prompts: list[tuple[int, ...]],
    lens: list[int],
    loras: list[LoraRequest | None],
    prefix: str = "r",
) -> list[EngineRequest]:
    return [
        EngineRequest(f"{prefix}{i}", p, greedy(m), lora=lora)
        for i, (p, m, lora) in enumerate(zip(prompts, lens, loras, strict=True))
    ]
