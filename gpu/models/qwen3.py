"""Qwen3 (dense): Qwen2 plus a per-head RMSNorm of q and k before RoPE, and no q/k/v biases by default."""

from __future__ import annotations

from typing import Any

from gpu.models.llama import Layer, Llama


class Qwen3(Llama):
    def layer(self, block: Any, index: int, packed: bool, windows: list[int | None]) -> Layer:
        base = super().layer(block, index, packed, windows)
        attn = block.self_attn
        return Layer(**{**base.__dict__, "q_norm": self.norm(attn.q_norm), "k_norm": self.norm(attn.k_norm)})
