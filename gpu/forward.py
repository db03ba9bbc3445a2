"""The Llama-family forward over flattened tokens, reading the HF model's weights and the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu.attention import PagedAttention
from gpu.cpu.linear import Linear
from gpu.cpu.rope_write import RopeCacheWrite
from gpu.inputs import StepInputs
from gpu.kv_cache import KVCache, KVShape
from gpu.model import LoadedModel
from gpu.models import architecture
from gpu.models.llama import Layer

# Attention of one layer: (q [T, heads, D], k/v [T, kv_heads, D] of the new tokens, layer) -> [T, heads, D].
# A layer's sliding window and soft-capping, if any, are the attention's to apply (LlamaForward.attn_options).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]

# A step's LoRA (gpu/lora): (layer, product, its input x, its output) -> the adapter rows' deltas added to
# the output in place. Products: "qkv", "o", "gate_up", "down". None: no row of the step has an adapter.
LoraApply = Callable[[int, str, torch.Tensor, torch.Tensor], None]

# Residual add + RMSNorm: (x, delta or None, weight, eps) -> (rms_norm(x + delta), x + delta).
AddRmsNorm = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As HF's LlamaRMSNorm: normalise in float32, scale in the model's dtype."""
    if x.dtype == torch.float32:  # the fused kernel gives bit-identical results in float32
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, heads, head_dim] with cos/sin of [T, 1, rotary_dim]: a partial rotary
    (rotary_dim < head_dim, Phi-4-mini) rotates the first rotary_dim dims and passes the rest."""
    if cos.shape[-1] != x.shape[-1]:
        rot = cos.shape[-1]
        return torch.cat((rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaForward:
    """Batched forward for every architecture of gpu/models (their differences described there: Llama's
    own path runs no extra operation); logits only for the rows that sample."""

    def __init__(self, loaded: LoadedModel, max_positions: int, packed: bool = True) -> None:
        arch = architecture(loaded.config)
        config = arch.text_config
        hf = arch.text_model(loaded.model)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = hf.layers[0].self_attn.scaling
        self.dtype, self.device = loaded.dtype, loaded.device
        from transformers.activations import ACT2FN

        self.act = ACT2FN[arch.activation()]
        self.silu = arch.activation() == "silu"  # the fused SiLU*up kernel applies
        self.embed = hf.embed_tokens.weight.detach()
        scale = arch.embed_scale()  # Gemma: sqrt(hidden), rounded to the model's dtype as HF does
        self.embed_scale = None if scale is None else torch.tensor(scale, dtype=self.dtype).item()
        self.final_norm = self._cast(arch.norm(hf.norm))
        self.final_softcap = arch.final_softcap()
        self.lm_head = Linear(arch.lm_head(loaded.model).weight.detach(), None, packed)
        windows = arch.windows()
        self.layers = [self._cast_layer(arch.layer(b, i, packed, windows)) for i, b in enumerate(hf.layers)]
        self.windows = [layer.window for layer in self.layers]  # per layer: sliding window or None
        self.attn_softcap = arch.attn_softcap()  # Gemma 2: cap * tanh(score / cap) before the softmax
        # What each layer's attention is told beyond Llama's arguments (nothing, for Llama itself):
        self.attn_options: list[dict[str, int | float]] = [
            {k: v for k, v in (("window", w), ("softcap", self.attn_softcap)) if v is not None}
            for w in self.windows
        ]
        self._ropes = arch.ropes(hf)
        self._static_rope = arch.static_rope(hf)
        self.max_positions = max_positions
        tables = [
            self._rope(torch.arange(max_positions, device=self.device), i) for i in range(len(self._ropes))
        ]
        self.rope_tables = [(cos.contiguous(), sin.contiguous()) for cos, sin in tables]
        self.rope_cos, self.rope_sin = self.rope_tables[0]
        self._partial_rope = self.rope_cos.shape[-1] != self.head_dim  # the fused kernel rotates whole heads
        # Fused kernels, set by the runner where measured faster; None: the torch operators.
        # RoPE and the K/V cache write in one pass (the native C kernel on CPU, Triton on CUDA):
        self.rope_write: RopeCacheWrite | None = None
        self.rope_write_checked = True  # check positions and slots on the host first (the C kernel's need)
        self.add_rms_norm: AddRmsNorm | None = None
        self.silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None  # [T, 2I] gate|up -> [T, I]

    def _cast(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(self.dtype)

    def _cast_layer(self, layer: Layer) -> Layer:
        """Norm weights an architecture computed in float32 (Gemma's 1 + w) in the model's dtype."""
        norms = ("input_norm", "post_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")
        return Layer(
            **{
                **layer.__dict__,
                **{n: self._cast(getattr(layer, n)) for n in norms if getattr(layer, n) is not None},
            }
        )

    def _fits(self, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache) -> bool:
        """The native kernel indexes without bounds checks: check the step's positions and slots once."""
        if self.rope_write is None or not self._static_rope or self._partial_rope:  # static whole-head tables
            return False
        if not self.rope_write_checked:
            return True
        slots_total = cache.num_blocks * cache.shape.block_size
        return int(positions.max()) < self.rope_cos.shape[0] and int(slots.max()) < slots_total

    @property
    def graph_safe(self) -> bool:
        """True when `run` has no data-dependent host work (the RoPE table is precomputed)."""
        return self._static_rope

    @property
    def kv_window(self) -> int | None:
        """The widest window when every layer attends within one (blocks behind it can be given back);
        None when any layer sees the whole context."""
        if not self.windows or any(w is None for w in self.windows):
            return None
        return max(w for w in self.windows if w is not None)

    def kv_shape(self, block_size: int) -> KVShape:
        return KVShape(len(self.layers), self.num_kv_heads, self.head_dim, block_size, self.dtype)

    def _rope(self, positions: torch.Tensor, table: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(1, dtype=self.dtype, device=self.device)
        return self._ropes[table](probe, positions)  # [T, rotary_dim]

    def __call__(
        self,
        inputs: StepInputs,
        cache: KVCache,
        attention: PagedAttention,
        lora: LoraApply | None = None,
    ) -> torch.Tensor:
        """Run every scheduled token; return logits [S, vocab] for inputs.sample_rows."""
        plan = attention.plan(inputs.attention, cache)

        options = self.attn_options

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            return attention(q, k, v, cache, layer, plan, self.scale, **options[layer])

        return self.run(
            inputs.input_ids, inputs.positions, inputs.slots, cache, attend, inputs.sample_rows, lora
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        attend: Attend,
        sample_rows: torch.Tensor | None,
        lora: LoraApply | None = None,
    ) -> torch.Tensor:
        """The layers over flattened tokens, attention through `attend`; logits of sample_rows (None: all);
        `lora` adds the step's adapter deltas to each product it adapts.

        Only tensor operations with shapes fixed by the inputs: a CUDA graph can capture it whole.
        """
        t = input_ids.numel()
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        fused = self.rope_write if t and self._fits(positions, slots, cache) else None
        if fused is None:
            ropes = []
            for table, (cos, sin) in enumerate(self.rope_tables):
                if not self._static_rope:
                    cos, sin = self._rope(positions, table)
                else:
                    cos, sin = cos[positions], sin[positions]
                ropes.append((cos[:, None, :], sin[:, None, :]))
        x, delta = self.embed[input_ids], None  # delta: the last block's output, not yet added to x
        if self.embed_scale is not None:
            x = x * self.embed_scale  # a host float: nothing made per step (CUDA graphs)
        for index, layer in enumerate(self.layers):
            h, x = self._add_norm(x, delta, layer.input_norm)
            qkv = layer.qkv(h)
            if lora is not None:
                lora(index, "qkv", h, qkv)
            qk, v = qkv.split((q_size + kv_size, kv_size), dim=-1)
            qk = qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            if layer.q_norm is not None:  # per-head RMSNorm of q and k before RoPE
                qk = self._qk_norm(qk, layer)
            if fused is not None:
                cos, sin = self.rope_tables[layer.rope]
                fused(qk, v, positions, cos, sin, cache, index, slots)  # in place
            else:
                qk = rotate(qk, *ropes[layer.rope])  # one RoPE call for q and k
                cache.write(index, slots, qk[:, self.num_heads :], v)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            attended = attend(q, k, v, index).reshape(t, q_size)
            attn = layer.o(attended)
            if lora is not None:
                lora(index, "o", attended, attn)
            if layer.attn_out_norm is not None:
                attn = rms_norm(attn, layer.attn_out_norm, self.eps)
            h, x = self._add_norm(x, attn, layer.post_norm)
            if lora is None:
                delta = layer.down(self._activation(layer.gate_up(h)))
            else:
                gate_up = layer.gate_up(h)
                lora(index, "gate_up", h, gate_up)
                activated = self._activation(gate_up)
                delta = layer.down(activated)
                lora(index, "down", activated, delta)
            if layer.mlp_out_norm is not None:
                delta = rms_norm(delta, layer.mlp_out_norm, self.eps)
        if sample_rows is not None:
            if sample_rows.numel() == 0:  # only prefill chunks that end before their last token
                return x.new_empty(0, self.lm_head.out_features, dtype=torch.float32)
            x, delta = x[sample_rows], delta[sample_rows] if delta is not None else None
        return self._softcap(self.lm_head(self._add_norm(x, delta, self.final_norm)[0])).float()

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma's final logit soft-capping, cap * tanh(logits / cap), in the model's dtype as HF does."""
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def _qk_norm(self, qk: torch.Tensor, layer: Layer) -> torch.Tensor:
        assert layer.q_norm is not None and layer.k_norm is not None
        q = rms_norm(qk[:, : self.num_heads], layer.q_norm, self.eps)
        return torch.cat((q, rms_norm(qk[:, self.num_heads :], layer.k_norm, self.eps)), dim=1)

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
