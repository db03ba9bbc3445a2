"""Gemma 3 (gemma3_text, and the language model of a gemma3 checkpoint, whose vision tower is not run):
Gemma 2 plus a per-head q/k RMSNorm ((1 + w)), local layers with their own RoPE base
(rope_local_base_freq) while global layers keep theirs (with its scaling), the local/global pattern from
layer_types (sliding_window_pattern), no attention soft-capping."""

from __future__ import annotations

from typing import Any

import torch

from gpu.models.gemma2 import Gemma2
from gpu.models.llama import STATIC_ROPE, Layer, RopeFn, Unsupported, rope_type


class Gemma3(Gemma2):
    @property
    def text_config(self) -> Any:
        return getattr(self.config, "text_config", None) or self.config

    @property
    def layer_types(self) -> list[str]:
        """The model's distinct layer types, one RoPE table each (HF makes none for an absent type)."""
        return sorted(set(self.text_config.layer_types))

    def check(self) -> None:
        config = self.text_config
        if getattr(config, "use_bidirectional_attention", False):
            raise Unsupported(f"{self.config.model_type}: bidirectional attention is not implemented")
        for layer_type in self.layer_types:
            kind = rope_type((config.rope_parameters or {}).get(layer_type))
            if kind not in STATIC_ROPE:
                raise Unsupported(
                    f"{self.config.model_type}: RoPE type {kind!r} ({layer_type}) is not implemented"
                )
        for feature in ("num_experts", "num_local_experts"):
            if getattr(config, feature, None):
                raise Unsupported(f"{self.config.model_type}: {feature} (MoE) is not implemented")

    def text_model(self, hf: Any) -> Any:
        model = hf.model
        return getattr(model, "language_model", model)  # gemma3: the multimodal wrapper's text model

    def layer(self, block: Any, index: int, packed: bool, windows: list[int | None]) -> Layer:
        base = super().layer(block, index, packed, windows)
        attn = block.self_attn
        rope = self.layer_types.index(self.text_config.layer_types[index])
        return Layer(
            **{
                **base.__dict__,
                "q_norm": self.norm(attn.q_norm),
                "k_norm": self.norm(attn.k_norm),
                "rope": rope,
            }
        )

    def static_rope(self, model: Any) -> bool:
        return True  # checked: every table is a static type

    def ropes(self, model: Any) -> list[RopeFn]:
        rotary = model.rotary_emb

        def table(layer_type: str) -> RopeFn:
            def rope(probe: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                cos, sin = rotary(probe, positions[None], layer_type)
                return cos[0], sin[0]

            return rope

        return [table(t) for t in self.layer_types]
