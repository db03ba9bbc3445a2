"""Gemma 2: Llama with embeddings scaled by sqrt(hidden), RMSNorm weights applied as (1 + w), norms on
the attention and MLP outputs before each residual add (pre- and post-norms), GeGLU
(gelu_pytorch_tanh), alternating local (sliding) and global layers, the attention scale from
query_pre_attn_scalar (read from HF's module), attention logit soft-capping and final logit soft-capping."""

from __future__ import annotations

from typing import Any

import torch

from gpu.models.llama import Layer, Llama


class Gemma2(Llama):
    def activation(self) -> str:
        config = self.text_config
        return getattr(config, "hidden_activation", None) or config.hidden_act

    def norm(self, module: Any) -> torch.Tensor:
        return 1.0 + module.weight.detach().float()  # cast back to the model's dtype by the forward

    def embed_scale(self) -> float | None:
        return self.text_config.hidden_size**0.5

    def final_softcap(self) -> float | None:
        return getattr(self.text_config, "final_logit_softcapping", None)

    def attn_softcap(self) -> float | None:
        return getattr(self.text_config, "attn_logit_softcapping", None)

    def layer(self, block: Any, index: int, packed: bool, windows: list[int | None]) -> Layer:
        base = super().layer(block, index, packed, windows)
        return Layer(
            **{
                **base.__dict__,
                "post_norm": self.norm(block.pre_feedforward_layernorm),
                "attn_out_norm": self.norm(block.post_attention_layernorm),
                "mlp_out_norm": self.norm(block.post_feedforward_layernorm),
            }
        )
