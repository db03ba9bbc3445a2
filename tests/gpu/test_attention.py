"""Paged attention and the KV cache against a dense causal reference."""

from __future__ import annotations

import torch

from gpu.attention import paged_attention
from gpu.inputs import build_inputs
from gpu.kv_cache import KVCache, KVShape
from gpu.runner import to_device
from scheduler.output import ScheduledChunk, SchedulerOutput
from scheduler.types import SamplingParams

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def chunk(seq_id, start, n, table, sample=True):
    return ScheduledChunk(seq_id, tuple(range(3, 3 + n)), start, tuple(table), sample, SamplingParams(), 0)


def dense_reference(q, k, v, start):
    """Causal attention of queries at positions start.. over keys 0..start+n-1, K/V repeated per group."""
    n, ctx = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    mask = torch.arange(ctx)[None, :] <= (start + torch.arange(n))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


def test_mixed_step_matches_dense_attention():
    torch.manual_seed(0)
    # (start, new tokens, block table): decodes with scattered blocks, a fresh prefill, a resumed chunk.
    specs = {
        "d1": (6, 1, [7, 2]),
        "d2": (12, 1, [1, 9, 4, 11]),
        "p1": (0, 9, [3, 8, 0]),
        "p2": (5, 6, [10, 5, 6]),
    }
    cache = KVCache(KVShape(1, KV_HEADS, DIM, BLOCK, torch.float32), 12, torch.device("cpu"))
    full_k, full_v = {}, {}
    for seq_id, (start, n, table) in specs.items():
        full_k[seq_id], full_v[seq_id] = (
            torch.randn(start + n, KV_HEADS, DIM),
            torch.randn(start + n, KV_HEADS, DIM),
        )
        if start:  # the cached prefix, written as an earlier step would have
            past = build_inputs(SchedulerOutput((chunk(seq_id, 0, start, table),), start, (), ()), BLOCK)
            cache.write(0, past.slots, full_k[seq_id][:start], full_v[seq_id][:start])
    step = SchedulerOutput(tuple(chunk(s, *spec) for s, spec in specs.items()), 17, (), ())
    inputs = build_inputs(step, BLOCK)
    new_k = torch.cat([full_k[s][st:] for s, (st, _, _) in specs.items()])
    new_v = torch.cat([full_v[s][st:] for s, (st, _, _) in specs.items()])
    cache.write(0, inputs.slots, new_k, new_v)
    q = torch.randn(inputs.input_ids.numel(), HEADS, DIM)
    got = paged_attention(q, cache, 0, inputs, DIM**-0.5)
    row = 0
    for seq_id, (start, n, _) in specs.items():
        want = dense_reference(q[row : row + n], full_k[seq_id], full_v[seq_id], start)
        torch.testing.assert_close(got[row : row + n], want, rtol=1e-5, atol=1e-5)
        row += n


def test_inputs_flatten_positions_slots_and_sample_rows():
    step = SchedulerOutput((chunk("a", 5, 1, [2, 0]), chunk("b", 2, 3, [1, 3], sample=False)), 4, (), ())
    inputs = build_inputs(step, BLOCK)
    assert inputs.positions.tolist() == [5, 2, 3, 4]
    assert inputs.slots.tolist() == [0 * BLOCK + 1, 1 * BLOCK + 2, 1 * BLOCK + 3, 3 * BLOCK + 0]
    assert inputs.sample_rows.tolist() == [0]
    assert [c.seq_id for c in inputs.sample_chunks] == ["a"]


def test_cache_is_zero_initialised_and_sized_from_budget():
    shape = KVShape(2, KV_HEADS, DIM, BLOCK, torch.float32)
    assert shape.bytes_per_block == 2 * 2 * BLOCK * KV_HEADS * DIM * 4
    blocks = shape.blocks_for_budget(10 * shape.bytes_per_block + 5)
    cache = KVCache(shape, blocks, torch.device("cpu"))
    assert blocks == 10 and cache.k.shape == (2, KV_HEADS, 10, BLOCK, DIM)
    assert not cache.k.any() and not cache.v.any()


def test_inputs_move_to_a_device_whole():
    step = SchedulerOutput((chunk("a", 5, 1, [2, 0]), chunk("b", 2, 3, [1, 3])), 4, (), ())
    inputs = build_inputs(step, BLOCK)
    moved = to_device(inputs, torch.device("cpu"))
    assert torch.equal(moved.slots, inputs.slots) and torch.equal(moved.decode.bias, inputs.decode.bias)
    assert torch.equal(moved.prefills[0].causal_bias, inputs.prefills[0].causal_bias)
    assert moved.sample_chunks == inputs.sample_chunks
