"""The architectures the runner implements: one module each, a new one built on its nearest relative.

`architecture(config)` gives the description gpu.forward runs; a config using a feature the runner lacks
(MoE, vision input, an unknown RoPE type, attention logit soft-capping where not implemented...) is refused
at load with that feature named, never served wrong.
"""

from __future__ import annotations

from typing import Any

from gpu.models.gemma2 import Gemma2
from gpu.models.gemma3 import Gemma3
from gpu.models.llama import Llama, Unsupported
from gpu.models.phi3 import Phi3
from gpu.models.qwen3 import Qwen3

ARCHITECTURES: dict[str, type[Llama]] = {
    "llama": Llama,
    "mistral": Llama,
    "qwen2": Llama,
    "qwen3": Qwen3,
    "phi3": Phi3,
    "gemma2": Gemma2,
    "gemma3_text": Gemma3,
    "gemma3": Gemma3,
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)

__all__ = ["ARCHITECTURES", "SUPPORTED_MODEL_TYPES", "Unsupported", "architecture"]


def architecture(config: Any) -> Llama:
    """The description of this checkpoint's architecture; raises Unsupported naming what is missing."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        supported = ", ".join(SUPPORTED_MODEL_TYPES)
        raise Unsupported(f"unsupported architecture {model_type!r}: the runner implements {supported}")
    arch = ARCHITECTURES[model_type](config)
    arch.check()
    return arch
