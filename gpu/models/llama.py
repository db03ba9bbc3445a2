"""Llama, Mistral and Qwen2: the base description every other architecture is built on.

An architecture says where the HF model keeps its weights and how its layers differ from Llama's; the one
forward in gpu/forward.py runs them all. Per layer: fused q|k|v and gate|up products, an optional
per-head q/k RMSNorm before RoPE, optional norms on the attention and MLP outputs (Gemma's sandwich), a
sliding window or none, and which RoPE table it reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpu.cpu.linear import Linear

# RoPE variants the runner implements; those whose frequencies do not depend on the batch share one table.
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}
DYNAMIC_ROPE = {"dynamic"}
# HF's Mistral and Phi-3 apply config.sliding_window to every layer, whatever layer_types says.
EVERY_LAYER_WINDOWED = {"mistral", "phi3"}

# (probe tensor of the model's dtype and device, positions [T]) -> (cos, sin) [T, rotary_dim]
RopeFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Unsupported(ValueError):
    """The checkpoint uses a feature the runner does not implement (named in the message)."""


@dataclass(frozen=True)
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # q, k and v projections fused into one product
    o: Linear
    post_norm: torch.Tensor  # the norm before the MLP
    gate_up: Linear  # gate and up projections fused
    down: Linear
    q_norm: torch.Tensor | None = None  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # norm of the attention output before the residual (Gemma)
    mlp_out_norm: torch.Tensor | None = None  # norm of the MLP output before the residual (Gemma)
    window: int | None = None  # sliding window: a query sees itself and the window - 1 keys before it
    rope: int = 0  # index of its RoPE table


def fuse(*linears: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linears' weights (and biases) stacked into one product's; fused in place: each HF module's
    weight becomes a view of the stacked tensor, so the device holds one copy, not two."""
    weight = torch.cat([m.weight.detach() for m in linears], dim=0)
    sizes = [m.out_features for m in linears]
    _share(weight, [m.weight for m in linears], sizes)
    if all(m.bias is None for m in linears):
        return weight, None
    biases = [m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features) for m in linears]
    bias = torch.cat(biases)
    _share(bias, [m.bias for m in linears], sizes)
    return weight, bias


def _share(fused: torch.Tensor, parts: list[torch.Tensor | None], sizes: list[int]) -> None:
    """Each part becomes its rows of `fused` (a view; the values are the same)."""
    start = 0
    for part, rows in zip(parts, sizes, strict=True):
        if part is not None:
            part.data = fused[start : start + rows]
        start += rows


def bias(linear: Any) -> torch.Tensor | None:
    return linear.bias.detach() if linear.bias is not None else None


def rope_type(parameters: dict[str, Any] | None) -> str:
    parameters = parameters or {}
    return parameters.get("rope_type", parameters.get("type", "default"))


class Llama:
    """llama, mistral, qwen2 (and the defaults of every other architecture)."""

    windowed = True  # the HF model applies config.sliding_window (Llama's does not)
    rope_types = STATIC_ROPE | DYNAMIC_ROPE

    def __init__(self, config: Any) -> None:
        self.config = config

    # --- what the checkpoint asks for, checked at load -------------------------------------------------
    def check(self) -> None:
        kind = rope_type(self.rope_parameters())
        if kind not in self.rope_types:
            raise Unsupported(f"{self.config.model_type}: RoPE type {kind!r} is not implemented")
        for feature in ("num_experts", "num_local_experts", "vision_config"):
            if getattr(self.config, feature, None):
                raise Unsupported(f"{self.config.model_type}: {feature} (MoE / vision) is not implemented")

    def rope_parameters(self) -> dict[str, Any] | None:
        return getattr(self.config, "rope_parameters", None) or getattr(self.config, "rope_scaling", None)

    @property
    def text_config(self) -> Any:
        return self.config

    def windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention), as the HF model applies them."""
        config = self.text_config
        n = config.num_hidden_layers
        window = getattr(config, "sliding_window", None) if self.windowed else None
        if self.config.model_type == "llama" or not window:
            return [None] * n
        types = getattr(config, "layer_types", None)
        if types is None or self.config.model_type in EVERY_LAYER_WINDOWED:
            return [window] * n
        return [window if t == "sliding_attention" else None for t in types]

    # --- where the weights are ---------------------------------------------------------------------------
    def text_model(self, hf: Any) -> Any:
        return hf.model

    def lm_head(self, hf: Any) -> Any:
        return hf.lm_head

    def activation(self) -> str:
        return self.text_config.hidden_act

    def norm(self, module: Any) -> torch.Tensor:
        """An RMSNorm's weight as rms_norm multiplies by it."""
        return module.weight.detach()

    def embed_scale(self) -> float | None:
        return None

    def final_softcap(self) -> float | None:
        return None

    def attn_softcap(self) -> float | None:
        return None

    def layer(self, block: Any, index: int, packed: bool, windows: list[int | None]) -> Layer:
        attn, mlp = block.self_attn, block.mlp
        return Layer(
            input_norm=self.norm(block.input_layernorm),
            qkv=Linear(*fuse(attn.q_proj, attn.k_proj, attn.v_proj), packed),
            o=Linear(attn.o_proj.weight.detach(), bias(attn.o_proj), packed),
            post_norm=self.norm(block.post_attention_layernorm),
            gate_up=Linear(*fuse(mlp.gate_proj, mlp.up_proj), packed),
            down=Linear(mlp.down_proj.weight.detach(), bias(mlp.down_proj), packed),
            window=windows[index],
        )

    def lora_parts(self) -> dict[str, tuple[str, ...]]:
        """Each product of Layer that LoRA may target: its HF modules (relative to a decoder layer), in the
        order their outputs are stacked (PEFT names a target by the module's last part, e.g. `q_proj`)."""
        return {
            "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "o": ("self_attn.o_proj",),
            "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
            "down": ("mlp.down_proj",),
        }

    # --- RoPE ----------------------------------------------------------------------------------------------
    def static_rope(self, model: Any) -> bool:
        return getattr(model.rotary_emb, "rope_type", "default") in STATIC_ROPE

    def ropes(self, model: Any) -> list[RopeFn]:
        """One table function per distinct RoPE of the model (layers pick theirs by Layer.rope)."""
        rotary = model.rotary_emb

        def rope(probe: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = rotary(probe, positions[None])
            return cos[0], sin[0]

        return [rope]
