"""The fused q|k|v and gate|up weights are the only copies: the HF modules' weights become views of them."""

from __future__ import annotations

import torch

from gpu.forward import LlamaForward
from tests.gpu.factories import make_model


def _inside(part: torch.Tensor, whole: torch.Tensor) -> bool:
    return part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def test_fused_weights_are_shared_with_the_hf_modules_and_hf_still_computes_the_same():
    model = make_model()
    hf = model.model
    block = hf.model.layers[0]
    ids = torch.tensor([[5, 9, 3, 7]])
    with torch.no_grad():
        before = hf(ids).logits
    forward = LlamaForward(model, max_positions=64, packed=False)
    layer = forward.layers[0]
    attn, mlp = block.self_attn, block.mlp
    assert all(_inside(m.weight, layer.qkv.weight) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert all(_inside(m.weight, layer.gate_up.weight) for m in (mlp.gate_proj, mlp.up_proj))
    q_rows = attn.q_proj.out_features
    assert torch.equal(attn.k_proj.weight, layer.qkv.weight[q_rows : q_rows + attn.k_proj.out_features])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, before)
