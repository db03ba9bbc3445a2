"""A loaded model's fingerprint: what must be equal for one worker to continue tokens another generated.

A job's saved progress is resumed only by a worker whose fingerprint equals the one saved with it: the
same weights and the same tokenizer (vocabulary, each token's bytes, chat template). It hashes the model's
type and sizes, every weight's name and shape and a strided sample of its values rounded to bfloat16
(so a float32 and a bfloat16 load of one checkpoint agree, and a fine-tune, whose every weight moves, does
not), and the tokenizer's bytes per token id. The weights' part is taken before the runner repacks any
weight; the tokenizer's (most of the time, for a small model) when the fingerprint is first asked for.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

VERSION = b"inferq-fingerprint-1"
SAMPLES_PER_WEIGHT = 256  # values hashed per weight, spread over the whole tensor


def model_fingerprint(model: Any) -> str:
    """`model`: a gpu.model.LoadedModel. 32 hex digits."""
    return combine(weights_digest(model), model)


def combine(weights: bytes, model: Any) -> str:
    """The fingerprint from `weights_digest` (taken while the weights were as loaded) and the tokenizer."""
    config = getattr(model.config, "text_config", None) or model.config
    digest = hashlib.sha256(VERSION + weights)
    digest.update(tokenizer_digest(model.tokenizer, getattr(config, "vocab_size", 0)))
    return digest.hexdigest()[:32]


def weights_digest(model: Any) -> bytes:
    """The model's type and sizes, and each weight's name, shape and sampled values."""
    digest = hashlib.sha256()
    config = getattr(model.config, "text_config", None) or model.config
    for name in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
        digest.update(f"{name}={getattr(config, name, None)};".encode())
    with torch.no_grad():
        for name, weight in sorted(model.model.state_dict().items()):
            digest.update(f"{name}{tuple(weight.shape)};".encode())
            if weight.is_floating_point() and weight.numel():
                flat = weight.detach().reshape(-1)
                sample = flat[:: max(1, flat.numel() // SAMPLES_PER_WEIGHT)][:SAMPLES_PER_WEIGHT]
                digest.update(sample.to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.digest()


def tokenizer_digest(tokenizer: Any, vocab_size: int) -> bytes:
    """The tokenizer's kind, chat template and bytes of every token id the model can emit."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    template = getattr(getattr(tokenizer, "hf", None), "chat_template", None)
    digest.update(repr(template).encode())
    token_bytes = getattr(tokenizer, "token_bytes", None) or (lambda i: tokenizer.decode([i]).encode())
    for token_id in range(vocab_size):
        try:
            piece = token_bytes(token_id)
        except Exception:  # noqa: BLE001 - an id the tokenizer has no bytes for: that is part of it too
            piece = b"\xff\xfe"
        digest.update(len(piece).to_bytes(4, "little") + bytes(piece))
    return digest.digest()
