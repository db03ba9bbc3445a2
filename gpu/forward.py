"""The Llama-family forward over flattened tokens, reading the HF model's weights and the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gpu.attention import PagedAttention
from gpu.cpu.linear import Linear
from gpu.cpu.rope_write import RopeCacheWrite
from gpu.inputs import StepInputs
from gpu.kv_cache import KVCache, KVShape
from gpu.model import LoadedModel, check_architecture

# Attention of one layer: (q [T, heads, D], k/v [T, kv_heads, D] of the new tokens, layer) -> [T, heads, D].
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]

# Residual add + RMSNorm: (x, delta or None, weight, eps) -> (rms_norm(x + delta), x + delta).
AddRmsNorm = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]

# RoPE variants whose frequencies do not depend on the batch, so one cos/sin table serves every step.
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As HF's LlamaRMSNorm: normalise in float32, scale in the model's dtype."""
    if x.dtype == torch.float32:  # the fused kernel gives bit-identical results in float32
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, heads, head_dim] with cos/sin of [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # q, k and v projections fused into one product
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # gate and up projections fused
    down: Linear


def _fuse(*linears: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
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


class LlamaForward:
    """Batched forward for llama/mistral/qwen2 configs; logits only for the rows that sample."""

    def __init__(self, loaded: LoadedModel, max_positions: int, packed: bool = True) -> None:
        config = loaded.config
        check_architecture(config)
        hf = loaded.model.model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = hf.layers[0].self_attn.scaling
        self.dtype, self.device = loaded.dtype, loaded.device
        from transformers.activations import ACT2FN

        self.act = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act == "silu"  # the fused SiLU*up kernel applies
        self.embed = hf.embed_tokens.weight.detach()
        self.final_norm = hf.norm.weight.detach()
        self.lm_head = Linear(loaded.model.lm_head.weight.detach(), None, packed)
        self.layers = [self._layer(block, packed) for block in hf.layers]
        self._rotary = hf.rotary_emb
        self._static_rope = getattr(hf.rotary_emb, "rope_type", "default") in _STATIC_ROPE
        self.max_positions = max_positions
        cos, sin = self._rope(torch.arange(max_positions, device=self.device))
        self.rope_cos, self.rope_sin = cos.contiguous(), sin.contiguous()
        # Fused kernels, set by the runner where measured faster; None: the torch operators.
        # RoPE and the K/V cache write in one pass (the native C kernel on CPU, Triton on CUDA):
        self.rope_write: RopeCacheWrite | None = None
        self.rope_write_checked = True  # check positions and slots on the host first (the C kernel's need)
        self.add_rms_norm: AddRmsNorm | None = None
        self.silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None  # [T, 2I] gate|up -> [T, I]

    @staticmethod
    def _layer(block: Any, packed: bool) -> Layer:
        attn, mlp = block.self_attn, block.mlp
        o_bias = attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None
        down_bias = mlp.down_proj.bias.detach() if mlp.down_proj.bias is not None else None
        return Layer(
            input_norm=block.input_layernorm.weight.detach(),
            qkv=Linear(*_fuse(attn.q_proj, attn.k_proj, attn.v_proj), packed),
            o=Linear(attn.o_proj.weight.detach(), o_bias, packed),
            post_norm=block.post_attention_layernorm.weight.detach(),
            gate_up=Linear(*_fuse(mlp.gate_proj, mlp.up_proj), packed),
            down=Linear(mlp.down_proj.weight.detach(), down_bias, packed),
        )

    def _fits(self, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache) -> bool:
        """The native kernel indexes without bounds checks: check the step's positions and slots once."""
        if self.rope_write is None or not self._static_rope:  # it reads the static cos/sin tables
            return False
        if not self.rope_write_checked:
            return True
        slots_total = cache.num_blocks * cache.shape.block_size
        return int(positions.max()) < self.rope_cos.shape[0] and int(slots.max()) < slots_total

    @property
    def graph_safe(self) -> bool:
        """True when `run` has no data-dependent host work (the RoPE table is precomputed)."""
        return self._static_rope

    def kv_shape(self, block_size: int) -> KVShape:
        return KVShape(len(self.layers), self.num_kv_heads, self.head_dim, block_size, self.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(1, dtype=self.dtype, device=self.device)
        cos, sin = self._rotary(probe, positions[None])
        return cos[0], sin[0]  # [T, head_dim]

    def __call__(self, inputs: StepInputs, cache: KVCache, attention: PagedAttention) -> torch.Tensor:
        """Run every scheduled token; return logits [S, vocab] for inputs.sample_rows."""
        plan = attention.plan(inputs.attention, cache)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            return attention(q, k, v, cache, layer, plan, self.scale)

        return self.run(inputs.input_ids, inputs.positions, inputs.slots, cache, attend, inputs.sample_rows)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        attend: Attend,
        sample_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """The layers over flattened tokens, attention through `attend`; logits of sample_rows (None: all).

        Only tensor operations with shapes fixed by the inputs: a CUDA graph can capture it whole.
        """
        t = input_ids.numel()
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        fused = self.rope_write if t and self._fits(positions, slots, cache) else None
        if fused is None:
            cos, sin = (
                (self.rope_cos[positions], self.rope_sin[positions])
                if self._static_rope
                else self._rope(positions)
            )
            cos, sin = cos[:, None, :], sin[:, None, :]
        x, delta = self.embed[input_ids], None  # delta: the last block's output, not yet added to x
        for index, layer in enumerate(self.layers):
            h, x = self._add_norm(x, delta, layer.input_norm)
            qk, v = layer.qkv(h).split((q_size + kv_size, kv_size), dim=-1)
            qk = qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            if fused is not None:
                fused(qk, v, positions, self.rope_cos, self.rope_sin, cache, index, slots)  # in place
            else:
                qk = rotate(qk, cos, sin)  # one RoPE call for q and k
                cache.write(index, slots, qk[:, self.num_heads :], v)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            h, x = self._add_norm(x, layer.o(attend(q, k, v, index).reshape(t, q_size)), layer.post_norm)
            delta = layer.down(self._activation(layer.gate_up(h)))
        if sample_rows is not None:
            if sample_rows.numel() == 0:  # only prefill chunks that end before their last token
                return x.new_empty(0, self.lm_head.out_features, dtype=torch.float32)
            x, delta = x[sample_rows], delta[sample_rows] if delta is not None else None
        return self.lm_head(self._add_norm(x, delta, self.final_norm)[0]).float()

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + delta), x + delta): one fused kernel where set, else HF's operators in order."""
        if self.add_rms_norm is not None:
            return self.add_rms_norm(x, delta, weight, self.eps)
        if delta is not None:
            x = x + delta
        return rms_norm(x, weight, self.eps), x

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.silu_mul is not None:
            return self.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up
