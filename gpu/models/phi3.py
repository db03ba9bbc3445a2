"""Phi-3, 3.5 and 4-mini: Llama with q|k|v and gate|up already fused in the checkpoint (qkv_proj,
gate_up_proj), a sliding window on every layer where the config sets one, partial rotary (Phi-4-mini
rotates 3/4 of each head) and `longrope` (`su`) scaling.

longrope: HF picks the short factors while a forward's largest position is inside
original_max_position_embeddings and the long ones past it. Here a token's RoPE follows its own
position (short inside, long past), one static table: equal to HF generate for every decoded token and
for prompts within the original context; a prompt longer than that is rotated with the short factors
for its first original_max_position_embeddings positions where HF would use the long ones (as vLLM, which
also chooses per step, differs from HF there).
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.cpu.linear import Linear
from gpu.models.llama import STATIC_ROPE, Layer, Llama, RopeFn, bias, rope_type


class Phi3(Llama):
    rope_types = STATIC_ROPE | {"longrope"}

    def layer(self, block: Any, index: int, packed: bool, windows: list[int | None]) -> Layer:
        attn, mlp = block.self_attn, block.mlp
        return Layer(
            input_norm=self.norm(block.input_layernorm),
            qkv=Linear(attn.qkv_proj.weight.detach(), bias(attn.qkv_proj), packed),
            o=Linear(attn.o_proj.weight.detach(), bias(attn.o_proj), packed),
            post_norm=self.norm(block.post_attention_layernorm),
            gate_up=Linear(mlp.gate_up_proj.weight.detach(), bias(mlp.gate_up_proj), packed),
            down=Linear(mlp.down_proj.weight.detach(), bias(mlp.down_proj), packed),
            window=windows[index],
        )

    def lora_parts(self) -> dict[str, tuple[str, ...]]:
        """LoRA on the checkpoint's own fused products (one adapter matrix pair over q|k|v, one over
        gate|up), as PEFT trains Phi-3."""
        return {
            "qkv": ("self_attn.qkv_proj",),
            "o": ("self_attn.o_proj",),
            "gate_up": ("mlp.gate_up_proj",),
            "down": ("mlp.down_proj",),
        }

    def static_rope(self, model: Any) -> bool:
        return rope_type(self.rope_parameters()) in self.rope_types

    def ropes(self, model: Any) -> list[RopeFn]:
        if rope_type(self.rope_parameters()) != "longrope":
            return super().ropes(model)
        rotary = model.rotary_emb
        original = self.rope_parameters()["original_max_position_embeddings"]

        def rope(probe: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # HF's table switches on the largest position of the call: ask once with every position
            # inside the original context (short factors), once with one past it (long factors).
            cos_short, sin_short = rotary(probe, positions.clamp(max=original - 1)[None])
            cos_long, sin_long = rotary(probe, torch.cat([positions, positions.new_tensor([original])])[None])
            inside = (positions < original)[:, None]
            return (
                torch.where(inside, cos_short[0], cos_long[0, :-1]),
                torch.where(inside, sin_short[0], sin_long[0, :-1]),
            )

        return [rope]
