"""Paged attention (every decode kernel) and the step inputs against a dense causal reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from gpu.attention import PagedAttention
from gpu.attention.torch_decode import plan_buckets
from gpu.cpu.native_decode import NativeDecode
from gpu.inputs import InputBuilder
from gpu.kv_cache import KVCache, KVShape
from gpu.runner import to_device
from scheduler.output import ScheduledChunk, SchedulerOutput
from scheduler.types import SamplingParams

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4
NATIVE = NativeDecode.load()
KERNELS = [
    pytest.param("native", marks=pytest.mark.skipif(NATIVE is None, reason="no C compiler for the kernel")),
    "torch",
]


def chunk(seq_id, start, n, table, sample=True):
    return ScheduledChunk(seq_id, tuple(range(3, 3 + n)), start, tuple(table), sample, SamplingParams(), 0)


def dense_reference(q, k, v, start, window=None, softcap=None):
    """Causal attention of queries at positions start.. over keys 0..start+n-1, K/V repeated per group;
    under a sliding window a query sees only itself and the window - 1 keys before it; soft-capped scores
    are softcap * tanh(score / softcap)."""
    n, ctx = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    offset = (start + torch.arange(n))[:, None] - torch.arange(ctx)[None, :]
    mask = (offset >= 0) & (offset < (window or ctx + 1))
    scores = q.transpose(0, 1) @ k.transpose(0, 1).transpose(-1, -2) * DIM**-0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v.transpose(0, 1)
    return out.transpose(0, 1)


def run_step(kernel: str, specs: dict, num_blocks: int, seed: int = 0, window=None, softcap=None) -> None:
    """specs: seq_id -> (start, new tokens, block table), in row order. Checks every row against dense."""
    torch.manual_seed(seed)
    cache = KVCache(KVShape(1, KV_HEADS, DIM, BLOCK, torch.float32), num_blocks, torch.device("cpu"))
    builder = InputBuilder(BLOCK, max_model_len=num_blocks * BLOCK, seats=4)
    full = {
        s: (torch.randn(st + n, KV_HEADS, DIM), torch.randn(st + n, KV_HEADS, DIM))
        for s, (st, n, _) in specs.items()
    }
    for seq_id, (start, _, table) in specs.items():
        if start:  # the cached prefix, written as an earlier step would have
            past = builder.build(SchedulerOutput((chunk(seq_id, 0, start, table),), start, (), (), 0))
            cache.write(0, past.slots, full[seq_id][0][:start], full[seq_id][1][:start])
    total = sum(n for _, n, _ in specs.values())
    inputs = builder.build(
        SchedulerOutput(tuple(chunk(s, *spec) for s, spec in specs.items()), total, (), (), 0)
    )
    new_k = torch.cat([full[s][0][st:] for s, (st, _, _) in specs.items()])
    new_v = torch.cat([full[s][1][st:] for s, (st, _, _) in specs.items()])
    cache.write(0, inputs.slots, new_k, new_v)
    q = torch.randn(total, HEADS, DIM)
    attention = PagedAttention(kernel, NATIVE)
    plan = attention.plan(inputs.attention, cache)
    got = attention(q, new_k, new_v, cache, 0, plan, DIM**-0.5, window=window, softcap=softcap)
    row = 0
    for seq_id, (start, n, _) in specs.items():
        want = dense_reference(q[row : row + n], *full[seq_id], start, window, softcap)
        torch.testing.assert_close(got[row : row + n], want, rtol=1e-5, atol=1e-5)
        row += n


@pytest.mark.parametrize("kernel", KERNELS)
def test_mixed_step_matches_dense_attention(kernel):
    # Decodes with scattered blocks, a fresh prefill, a resumed chunk, then a one-token chunk after the
    # prefills (so decode rows are not one contiguous run).
    specs = {
        "d1": (6, 1, [7, 2]),
        "d2": (12, 1, [1, 9, 4, 11]),
        "p1": (0, 9, [3, 8, 0]),
        "p2": (5, 6, [10, 5, 6]),
        "d3": (3, 1, [12]),
    }
    run_step(kernel, specs, num_blocks=13)


@pytest.mark.parametrize("window", [1, 3, 5, 8])
@pytest.mark.parametrize("kernel", KERNELS)
def test_sliding_window_mixed_step_matches_dense_attention(kernel, window):
    """Decodes whose window starts mid-block, at a block edge or covers the whole context; a fresh
    prefill longer than the window; a resumed chunk whose window reaches into its cached prefix."""
    specs = {
        "d1": (6, 1, [7, 2]),
        "d2": (12, 1, [1, 9, 4, 11]),
        "p1": (0, 9, [3, 8, 0]),
        "p2": (5, 6, [10, 5, 6]),
        "d3": (3, 1, [12]),
    }
    run_step(kernel, specs, num_blocks=13, window=window)
    run_step(kernel, {"p": (0, 4, [0])}, num_blocks=1, window=window)  # a fresh chunk within the window


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kernel", KERNELS)
def test_soft_capped_scores_match_dense_attention(kernel, window):
    """Gemma 2's attention logit soft-capping, with and without a window (a cap small enough to bite)."""
    specs = {"d1": (6, 1, [7, 2]), "p1": (0, 9, [3, 8, 0]), "p2": (5, 6, [10, 5, 6]), "d3": (3, 1, [12])}
    run_step(kernel, specs, num_blocks=13, window=window, softcap=0.7)


@pytest.mark.parametrize("kernel", KERNELS)
def test_many_decodes_of_very_different_lengths(kernel):
    """Enough rows for several context-length buckets in the torch kernel."""
    rng = random.Random(1)
    blocks = list(range(1600))
    rng.shuffle(blocks)
    specs = {}
    for i in range(40):
        length = rng.choice([2, 5, 30, 70, 150])
        need = -(-(length + 1) // BLOCK)
        specs[f"s{i}"] = (length, 1, [blocks.pop() for _ in range(need)])
    run_step(kernel, specs, num_blocks=1600)
    run_step(kernel, specs, num_blocks=1600, window=37)  # windowed, in every bucket


def test_inputs_flatten_positions_slots_and_sample_rows():
    builder = InputBuilder(BLOCK, max_model_len=64, seats=2)
    step = SchedulerOutput((chunk("a", 5, 1, [2, 0]), chunk("b", 2, 3, [1, 3], sample=False)), 4, (), (), 0)
    inputs = builder.build(step)
    assert inputs.positions.tolist() == [5, 2, 3, 4]
    assert inputs.slots.tolist() == [0 * BLOCK + 1, 1 * BLOCK + 2, 1 * BLOCK + 3, 3 * BLOCK + 0]
    assert inputs.sample_rows.tolist() == [0]
    assert [c.seq_id for c in inputs.sample_chunks] == ["a"]
    meta = inputs.attention
    assert meta.decode_rows.tolist() == [0] and meta.decode_lens.tolist() == [6] and meta.decode_first == 0
    assert [(p.row_start, p.num_tokens, p.start_position) for p in meta.prefills] == [(1, 3, 2)]


def test_block_tables_persist_and_update_incrementally():
    builder = InputBuilder(BLOCK, max_model_len=64, seats=2)
    a = builder.seat_of(chunk("a", 0, 3, [5]))
    assert builder.block_tables[a, :1].tolist() == [5]
    builder.seat_of(chunk("a", 3, 2, [5, 9]))
    assert builder.block_tables[a, :2].tolist() == [5, 9]
    b = builder.seat_of(chunk("b", 0, 2, [4]))
    assert b != a
    builder.release("a")
    assert builder.seat_of(chunk("c", 0, 2, [7])) == a  # a released seat is reused
    # A sequence readmitted with new blocks, without a release, still gets its new table.
    builder.seat_of(chunk("b", 0, 5, [6, 8]))
    assert builder.block_tables[b, :2].tolist() == [6, 8]


def test_device_table_updates_are_the_entries_written_since_the_last_step():
    """With device_tables each step carries what changed since the step before (a new sequence's whole
    row, the blocks an old one gained, a readmitted or re-seated sequence's whole new row, everything after
    forget()), and those updates, applied in order, keep a copy of the table equal to the host's."""
    builder = InputBuilder(BLOCK, max_model_len=64, seats=2, device_tables=True)
    width = builder.max_blocks
    copy = np.full((2, width), -1, dtype=np.int64)

    def step(*chunks, previous=None):
        updates = builder.build(SchedulerOutput(chunks, 1, (), (), 0), previous).table_updates
        assert updates is not None and updates.seats == len(builder.block_tables)
        if updates.seats > len(copy):
            copy.resize((updates.seats, width), refcheck=False)
        copy.reshape(-1)[updates.index] = updates.values
        for c in chunks:  # every row this step reads is the device's too
            seat = builder.seat_of(c)
            assert copy[seat, : len(c.block_table)].tolist() == list(c.block_table)
        return sorted(zip((updates.index // width).tolist(), (updates.index % width).tolist(), strict=True))

    a = step(chunk("a", 0, 3, [5]), chunk("b", 0, 2, [4, 2]))
    sa, sb = builder.seat_of(chunk("a", 0, 3, [5])), builder.seat_of(chunk("b", 0, 2, [4, 2]))
    assert a == sorted([(sa, 0), (sb, 0), (sb, 1)])
    assert step(chunk("a", 3, 1, [5]), chunk("b", 2, 1, [4, 2])) == []  # no new block: nothing copied
    assert step(chunk("a", 4, 1, [5, 9]), chunk("b", 3, 1, [4, 2])) == [(sa, 1)]  # one gained block
    assert step(chunk("b", 0, 4, [6, 8]), previous=[]) == [(sb, 0), (sb, 1)]  # readmitted: a new table
    builder.release("a")
    assert step(chunk("c", 0, 2, [7])) == [(sa, 0)]  # the seat's new sequence writes its own row
    builder.forget()
    assert step(chunk("c", 2, 1, [7]), chunk("b", 4, 1, [6, 8])) == sorted([(sa, 0), (sb, 0), (sb, 1)])
    grown = step(chunk("c", 3, 1, [7]), chunk("d", 0, 1, [11]), chunk("e", 0, 1, [12]))  # a third seat
    assert len(builder.block_tables) == 4 and [entry[1] for entry in grown] == [0, 0]


def test_an_async_step_table_is_its_own_rows_up_to_its_widest_context():
    """On the CPU an async scheduling step's table is its chunks' rows, chunk i's in row i, cut to the
    widest context: the next build may change the persistent table while this step runs."""
    builder = InputBuilder(BLOCK, max_model_len=4096, seats=8)
    for name, blocks in (("x", [30, 31]), ("y", [40])):  # other sequences hold seats 0 and 1
        builder.seat_of(chunk(name, 0, 2, blocks))
    step = SchedulerOutput((chunk("a", 5, 1, [2, 0]), chunk("b", 2, 3, [1, 3])), 4, (), (), 0)
    persistent = builder.build(step).attention
    assert persistent.block_tables.shape == (8, 4096 // BLOCK)
    assert persistent.decode_seats.tolist() == [2] and [p.seat for p in persistent.prefills] == [3]
    meta = builder.build(step, previous=[]).attention
    assert meta.block_tables.tolist() == [[2, 0], [1, 3]]  # widest context: 6 keys, 2 blocks
    assert meta.decode_seats.tolist() == [0] and [p.seat for p in meta.prefills] == [1]
    assert [p.row_start for p in meta.prefills] == [p.row_start for p in persistent.prefills]


def test_more_live_sequences_than_seats_grow_the_tables():
    builder = InputBuilder(BLOCK, max_model_len=64, seats=1)
    seats = {builder.seat_of(chunk(f"s{i}", 0, 2, [i])) for i in range(3)}
    assert len(seats) == 3 and all(builder.block_tables[s, 0] == i for i, s in enumerate(sorted(seats)))


def test_cache_is_zero_initialised():
    cache = KVCache(KVShape(2, KV_HEADS, DIM, BLOCK, torch.float32), 10, torch.device("cpu"))
    assert cache.k.shape == (2, KV_HEADS, 10, BLOCK, DIM)
    assert not cache.k.any() and not cache.v.any()


def test_inputs_move_to_a_device_whole():
    step = SchedulerOutput((chunk("a", 5, 1, [2, 0]), chunk("b", 2, 3, [1, 3])), 4, (), (), 0)
    inputs = InputBuilder(BLOCK, max_model_len=64).build(step)
    moved = to_device(inputs, torch.device("cpu"))
    assert torch.equal(moved.slots, inputs.slots)
    assert torch.equal(moved.attention.decode_lens, inputs.attention.decode_lens)
    assert moved.attention.prefills == inputs.attention.prefills
    assert moved.sample_chunks == inputs.sample_chunks


def test_buckets_partition_decode_rows_and_bound_padding():
    builder = InputBuilder(BLOCK, max_model_len=4096, seats=64)
    lengths = [3] * 10 + [40] * 12 + [400] * 9
    step = SchedulerOutput(
        tuple(chunk(f"s{i}", n, 1, range(n // BLOCK + 1)) for i, n in enumerate(lengths)), 31, (), (), 0
    )
    meta = builder.build(step).attention
    buckets = plan_buckets(meta, BLOCK, torch.float32)
    assert len(buckets) == 3
    rows = sorted(r for b in buckets for r in b.rows.tolist())
    assert rows == list(range(len(lengths)))
    for bucket in buckets:
        lens = meta.decode_lens[bucket.rows]
        assert (
            bucket.max_blocks == -(-int(lens.max()) // BLOCK)
            and int(lens.max()) <= 2 * int(lens.min()) + BLOCK
        )


def _count_sdpa_calls(monkeypatch) -> list[int]:
    from gpu.attention import prefill

    calls, sdpa = [], prefill._sdpa
    monkeypatch.setattr(prefill, "_sdpa", lambda q, *a, **kw: calls.append(q.shape[0]) or sdpa(q, *a, **kw))
    return calls


def test_short_prefills_are_packed_into_one_attention_call(monkeypatch):
    """Fresh prompts, resumed chunks and decode rows between them: one SDPA call for all the chunks."""
    from gpu.attention import prefill

    monkeypatch.setattr(prefill, "PACK_KEYS", 64)
    calls = _count_sdpa_calls(monkeypatch)
    specs = {
        "p1": (0, 5, [3, 8]),
        "d1": (6, 1, [7, 2]),
        "p2": (5, 6, [10, 5, 6]),
        "p3": (0, 2, [0]),
        "p4": (9, 3, [1, 9, 4]),
        "d2": (3, 1, [12]),
        "p5": (0, 7, [11, 13]),
    }
    run_step("torch", specs, num_blocks=14)
    assert calls == [5 + 6 + 2 + 3 + 7]


def test_fresh_prompts_pack_and_a_long_chunk_runs_alone(monkeypatch):
    from gpu.attention import prefill

    monkeypatch.setattr(prefill, "PACK_KEYS", 16)
    calls = _count_sdpa_calls(monkeypatch)
    specs = {
        "a": (0, 4, [0]),
        "b": (0, 3, [1]),
        "c": (0, 6, [2, 3]),
        "d": (0, 20, [4, 5, 6, 7, 8]),
        "e": (0, 2, [9]),
        "f": (4, 3, [10, 11]),
    }
    run_step("torch", specs, num_blocks=12)
    # packs of <= 16 keys in row order: a+b+c (13), d alone (20 keys: the causal kernel), e+f (2 + 7)
    assert calls == [13, 20, 5]


def test_the_mask_keeps_each_query_to_its_own_sequence_and_past():
    from gpu.attention.prefill import attention_mask

    seq, pos = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([3, 4, 0, 1, 2])
    keys_seq, keys_pos = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1]), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    mask = attention_mask(seq, pos, keys_seq, keys_pos)
    assert mask.int().tolist() == [
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1, 1],
    ]


def test_the_pack_limit_is_set_measured_once_per_shape_or_large_on_a_gpu(monkeypatch):
    from gpu.attention import prefill

    monkeypatch.setattr(prefill, "PACK_KEYS", None)
    monkeypatch.setattr(prefill, "_measured", {})
    measured = prefill.pack_keys(2, 8, torch.float32, torch.device("cpu"))
    assert measured in (0, *prefill.CANDIDATES)
    assert prefill._measured == {(2, 8, torch.float32): measured}
    assert prefill.pack_keys(2, 8, torch.float32, torch.device("meta")) == prefill.CUDA_PACK_KEYS
    monkeypatch.setattr(prefill, "PACK_KEYS", 7)
    assert prefill.pack_keys(2, 8, torch.float32, torch.device("cpu")) == 7
