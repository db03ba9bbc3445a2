"""Model loading: the built-in default Llama (seeded, no files) or any local Hugging Face checkpoint."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from gpu.tokenizer import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer, HFTokenizer, Tokenizer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # the transformers *ForCausalLM, in eval mode
    config: Any  # its PretrainedConfig
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype


def default_config(**overrides: Any) -> Any:
    """The built-in model's shape (≈19M parameters); tests shrink it through overrides."""
    from transformers import LlamaConfig

    shape = dict(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    shape.update(overrides)
    return LlamaConfig(**shape)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def check_architecture(config: Any) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(SUPPORTED_MODEL_TYPES)
        raise ValueError(f"unsupported architecture {model_type!r}: the runner implements {supported}")


def build_default(config: Any, seed: int = 0) -> Any:
    """A LlamaForCausalLM with deterministic weights: same seed, same model, without touching global RNG."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def _load_tokenizer(path: str, config: Any) -> Tokenizer:
    from transformers import AutoTokenizer

    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError, TypeError):
        # A checkpoint saved without tokenizer files (e.g. the default model written by save_pretrained).
        return ByteTokenizer(config.vocab_size)


def load_model(
    path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0
) -> LoadedModel:
    """Load a causal LM for the runner; never touches the network."""
    torch_dtype = parse_dtype(dtype)
    torch_device = torch.device(device)
    if path is None:
        config = default_config()
        model = build_default(config, seed)
        tokenizer: Tokenizer = ByteTokenizer(config.vocab_size)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory not found: {path}")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        check_architecture(config)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch_dtype)
        tokenizer = _load_tokenizer(path, config)
    model = model.to(device=torch_device, dtype=torch_dtype).eval()
    return LoadedModel(
        model=model, config=model.config, tokenizer=tokenizer, device=torch_device, dtype=torch_dtype
    )
