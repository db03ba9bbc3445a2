"""Sampler: exact fast argmax, batched top-k/top-p/temperature, draws that follow the distribution,
counter-based randomness (seed, sample, position) independent of batch mates and order, and no host read
of a device value anywhere in a step's sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.engine import EngineRequest
from gpu.sampler import SamplingBatch, draw, fast_argmax, filter_logits, sample
from gpu.samples import stream_key, uniforms
from scheduler.output import ScheduledChunk
from scheduler.types import SamplingParams
from tests.gpu.factories import make_engine, make_prompts


def batch_of(
    params: list[SamplingParams], keys: list[int], positions: list[int], vocab: int
) -> SamplingBatch:
    batch = SamplingBatch.build(params, keys, positions, vocab)
    assert batch is not None
    return batch


def filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Every row's logits after its own filters (all rows draw)."""
    return filter_logits(logits, batch_of(params, [0] * len(params), [0] * len(params), logits.shape[-1]))


def kept(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    return torch.isfinite(filtered(logits[None], [params])[0]).nonzero().flatten().tolist()


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 1) -> list[int]:
    """n draws of one distribution: positions 0..n-1 of one seed's stream."""
    batch = batch_of([params] * n, [stream_key(seed, 0)] * n, list(range(n)), logits.shape[-1])
    return sample(logits[None].expand(n, -1).contiguous(), batch).tolist()


def test_fast_argmax_equals_torch_argmax_including_ties():
    torch.manual_seed(0)
    for vocab in (32000, 300, 128, 7):
        logits = torch.randn(9, vocab)
        logits[1, :] = 0.0  # all tied: the first index wins
        logits[2, vocab // 2] = logits[2, vocab - 1] = 100.0  # tie across blocks
        logits[3, 1] = logits[3, 2] = 100.0  # tie within a block
        assert fast_argmax(logits).tolist() == torch.argmax(logits, dim=-1).tolist()


def test_top_k_restricts_support():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0, 2.5])
    params = SamplingParams(temperature=1.0, top_k=3)
    assert kept(logits, params) == [1, 3, 5]
    assert set(draws(logits, params, 300)) == {1, 3, 5}


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([0.05, 0.5, 0.3, 0.15]).log()
    for top_p, want in ((0.5, [1]), (0.7, [1, 2]), (0.85, [1, 2, 3]), (0.97, [0, 1, 2, 3])):
        assert kept(logits, SamplingParams(temperature=1.0, top_p=top_p)) == want, top_p
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.7), 300)) == {1, 2}


def test_rows_with_different_settings_are_filtered_independently():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 4)
    params = [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.5, top_k=2),
        SamplingParams(temperature=1.0),
    ]
    out = filtered(logits, params)
    assert torch.isfinite(out).tolist() == [
        [False, True, False, False],
        [False, True, False, False],  # top-p 0.5: the 3.0 token alone holds over half the mass
        [False, True, False, True],
        [True, True, True, True],  # neither filter: the others' leave it exactly as it was
    ]
    assert out[2, 1].item() == pytest.approx(6.0)  # temperature 0.5 doubles the logits
    assert torch.equal(out[3], logits[3])


def test_a_row_is_filtered_and_drawn_the_same_whatever_its_batch_mates_use():
    """Each row's token depends on that row alone: alone, beside rows using other filters, in any order."""
    torch.manual_seed(5)
    vocab = 300
    logits = torch.randn(6, vocab) * 3
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=20),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=vocab + 5),  # past the vocabulary: off
        SamplingParams(),  # greedy
    ]
    keys = [stream_key(s, 0) for s in range(6)]
    positions = [3, 0, 7, 1, 2, 0]
    together = sample(logits.clone(), batch_of(params, keys, positions, vocab)).tolist()
    for i in range(6):
        alone = sample(
            logits[i : i + 1].clone(), SamplingBatch.build([params[i]], [keys[i]], [positions[i]], vocab)
        )
        assert alone.tolist() == [together[i]]
    order = [4, 2, 5, 0, 3, 1]
    shuffled = SamplingBatch.build(
        [params[i] for i in order], [keys[i] for i in order], [positions[i] for i in order], vocab
    )
    assert sample(logits[order].clone(), shuffled).tolist() == [together[i] for i in order]


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    seen = expected > 0
    assert counts[~seen].sum() == 0  # nothing where the distribution has no mass
    return float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 8000
    counts = np.bincount(draws(probs.log(), SamplingParams(temperature=1.0), n, seed=7), minlength=4)
    assert chi_square(counts, probs.numpy()) < 16.3  # 3 degrees of freedom, p = 0.001


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=6, top_p=0.9),
    ],
)
def test_draws_across_seeds_follow_the_filtered_distribution(params):
    """The first token of 6000 requests seeded 0..5999 over an 8-token vocabulary: the counts fit the
    distribution temperature, top-k and top-p leave (computed here independently, in float64)."""
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.7], dtype=torch.float64)
    n = 6000
    batch = batch_of([params] * n, [stream_key(s, 0) for s in range(n)], [0] * n, 8)
    counts = np.bincount(sample(logits.float()[None].expand(n, -1).contiguous(), batch).numpy(), minlength=8)
    scaled = logits / params.temperature
    order = torch.argsort(scaled, descending=True)
    keep = torch.zeros(8, dtype=torch.bool)
    keep[order[: params.top_k or 8]] = True
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    if params.top_p < 1.0:
        before = torch.cumsum(probs[order], dim=0) - probs[order]
        keep[order[before >= params.top_p]] = False
        probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    degrees = int(keep.sum()) - 1
    assert chi_square(counts, probs.numpy()) < {7: 24.3, 5: 20.5, 4: 18.5, 3: 16.3, 2: 13.8}[degrees]


def test_zero_probability_tokens_are_never_drawn():
    logits = torch.full((2, 50), float("-inf"))
    logits[:, 17] = 0.0
    logits[1, 49] = 0.0
    u = torch.tensor([0.999999, 0.999999], dtype=torch.float64)
    assert draw(logits, u).tolist() == [17, 49]
    assert draw(logits, torch.zeros(2, dtype=torch.float64)).tolist() == [17, 17]


def test_uniforms_depend_only_on_seed_sample_and_position():
    key = np.array([stream_key(5, 0), stream_key(5, 0), stream_key(6, 0), stream_key(5, 1)], dtype=np.int64)
    a = uniforms(key, np.array([0, 1, 0, 0]))
    b = uniforms(key[[2, 1, 3]], np.array([0, 1, 0]))
    assert a[2] == b[0] and a[1] == b[1] and a[3] == b[2] and len(set(a.tolist())) == 4
    assert ((a >= 0) & (a < 1)).all()
    assert stream_key(2**63 - 1, 3) != stream_key(2**63 - 1, 2)  # the largest seed a job may carry


def test_uniforms_are_splitmix64s_outputs_at_each_rows_key_and_position():
    """The formula of gpu/samples.py, one row at a time in Python integers: a draw resumed or replayed by
    another build of the engine (or another machine) must land on the same bits."""
    from gpu.samples import _GOLDEN, _MASK, _mix64

    keys = [stream_key(seed, i) for seed, i in ((0, 0), (1, 0), (2**63 - 1, 3), (12345, 7))]
    positions = [0, 1, 2**40 + 3, 999]
    got = uniforms(np.array(keys, dtype=np.int64), np.array(positions, dtype=np.int64)).tolist()
    want = [
        (_mix64((k + (p + 1) * _GOLDEN) & _MASK) >> 12) / 2**52 for k, p in zip(keys, positions, strict=True)
    ]
    assert got == want


def test_uniforms_of_one_stream_and_across_seeds_are_uniform():
    """Positions 0..N-1 of one seed, and position 0 of N consecutive seeds (1, 2, 3...: unrelated streams):
    each fills 16 equal bins as uniform numbers do (chi-square, 15 degrees of freedom, p = 0.001: 37.7)."""
    n = 16_000
    along = uniforms(np.full(n, stream_key(1, 0), dtype=np.int64), np.arange(n))
    across = uniforms(np.array([stream_key(s, 0) for s in range(n)], dtype=np.int64), np.zeros(n, np.int64))
    for u in (along, across):
        counts = np.bincount((u * 16).astype(int), minlength=16)
        assert float(((counts - n / 16) ** 2 / (n / 16)).sum()) < 37.7
    assert abs(np.corrcoef(along[:-1], along[1:])[0, 1]) < 0.05  # no serial correlation


def test_greedy_rows_are_argmax_beside_sampling_rows():
    torch.manual_seed(3)
    logits = torch.randn(4, 100)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(),
        SamplingParams(temperature=0.5),
    ]
    tokens = sample(logits, SamplingBatch.build(params, [1, 2, 3, 4], [0, 0, 0, 0], 100)).tolist()
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


def test_an_argmax_computed_on_the_device_gives_the_same_tokens_and_is_never_written_into():
    """The CUDA graphs return each row's argmax with the logits: sampling rows still draw, greedy rows take
    it as is, and the graph's output buffer keeps its values (the next replay owns it)."""
    torch.manual_seed(4)
    logits = torch.randn(4, 100)
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(top_k=3)]
    batch = SamplingBatch.build(params, [1, 2, 3, 4], [0, 5, 0, 7], 100)
    greedy = logits.argmax(dim=-1)
    before = greedy.clone()
    assert sample(logits, batch, greedy=greedy).tolist() == sample(logits, batch).tolist()
    assert torch.equal(greedy, before)
    assert sample(logits, None, greedy=greedy).tolist() == before.tolist()


def test_seeded_sampling_is_reproducible_regardless_of_batch_mates():
    prompt = make_prompts(1, 20, 20, seed=11)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=1234)
    alone = make_engine().generate([EngineRequest("x", prompt, params)])["x"]
    mates = [
        EngineRequest(f"m{i}", p, SamplingParams(max_tokens=15, temperature=0.8, top_k=5 + i, seed=i))
        for i, p in enumerate(make_prompts(5, 3, 40, seed=12))
    ]
    crowded = make_engine(max_num_batched_tokens=32).generate(
        [*mates[:3], EngineRequest("x", prompt, params), *mates[3:]]
    )
    assert crowded["x"] == alone
    reseeded = EngineRequest("x", prompt, SamplingParams(20, 1.0, 0.95, seed=99))
    other_seed = make_engine().generate([reseeded])["x"]
    assert other_seed != alone


def test_a_seeded_request_draws_the_same_tokens_reordered_async_and_preempted():
    """Its randomness is (seed, sample, position) alone: batch mates in another order, async scheduling and
    recompute after preemption (a cache too small for every sequence) change none of its tokens."""
    prompt = make_prompts(1, 30, 30, seed=13)[0]
    params = SamplingParams(max_tokens=24, temperature=1.0, top_k=40, top_p=0.9, seed=4321, ignore_eos=True)
    alone = make_engine().generate([EngineRequest("x", prompt, params)])["x"]
    mates = [
        EngineRequest(f"m{i}", p, SamplingParams(max_tokens=24, temperature=0.9, seed=i, ignore_eos=True))
        for i, p in enumerate(make_prompts(6, 20, 40, seed=14))
    ]
    x = EngineRequest("x", prompt, params)
    for order, config in (
        ([x, *mates], dict(async_scheduling=True)),
        ([*reversed(mates), x], dict(max_num_batched_tokens=24, max_num_seqs=8)),
        ([*mates[:3], x, *mates[3:]], dict(num_blocks=14, max_num_batched_tokens=64, max_num_seqs=8)),
    ):
        engine = make_engine(**config)
        assert engine.generate(order)["x"] == alone, config
    assert engine.stats().preemptions > 0  # the last run recomputed sequences
    reseeded = make_engine().generate(
        [EngineRequest("x", prompt, SamplingParams(**{**params.__dict__, "seed": 1}))]
    )
    assert reseeded["x"] != alone


def test_the_sampling_table_counts_its_drawing_rows_and_reuses_rows():
    from gpu.sampling_table import SamplingTable

    table = SamplingTable(capacity=2)
    table.add("g", 1, SamplingParams())
    assert table.drawing == 0
    for i in range(5):  # past the capacity: the columns grow
        table.add(f"s{i}", 10 + i, SamplingParams(temperature=0.5, top_k=3, presence_penalty=0.2))
    assert table.drawing == 5 and table.key("s4") == 14 and table.penalised[table.row("s4")]
    table.add("s0", 7, SamplingParams())  # settings replaced: greedy now
    table.drop("s1")
    table.drop("s1")  # twice: nothing more
    assert table.drawing == 3
    table.add("t", 99, SamplingParams(temperature=1.0, logprobs=2))  # takes a freed row
    assert table.drawing == 4 and table.host[table.row("t")] and not table.penalised[table.row("t")]
    assert table.rows([type("C", (), {"seq_id": s})() for s in ("t", "g")]).tolist() == [
        table.row("t"),
        table.row("g"),
    ]


def test_a_repeated_step_reuses_its_rows_settings_and_a_changed_row_voids_them():
    """Decode steps repeat the step before: its rows' settings are derived once (SamplingTable.derived),
    the uniforms still follow each row's position, and a row whose settings change is read again."""
    from gpu.sampling_table import SamplingTable

    table = SamplingTable()
    drawn = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    table.add("a", 11, drawn)
    table.add("g", 12, SamplingParams())
    table.add("b", 13, drawn)

    def step(generated: int) -> tuple[list, SamplingBatch]:
        chunks = [ScheduledChunk(s, (0,), 0, (), True, SamplingParams(), generated) for s in ("a", "g", "b")]
        return chunks, SamplingBatch.for_step(table, chunks, 100)

    first_chunks, first = step(3)
    _, second = step(4)
    assert table.rows(first_chunks) is table.rows(first_chunks)  # the same rows: looked up once
    assert second.temperature is first.temperature and second.top_k is first.top_k
    assert second.rows.tolist() == [0, 2] and not second.draws_all
    keys = np.array([11, 13], dtype=np.int64)
    assert second.uniforms.tolist() == uniforms(keys, np.array([4, 4])).tolist()
    assert first.uniforms.tolist() == uniforms(keys, np.array([3, 3])).tolist()
    table.add("b", 13, SamplingParams(temperature=0.5, top_k=2))  # its settings replaced
    _, third = step(5)
    assert third.temperature.tolist() == pytest.approx([0.7, 0.5])
    assert third.top_k.tolist() == [4, 1] and third.top_p.tolist() == pytest.approx([0.9, 2.0])
    table.drop("a")
    table.add("a", 11, SamplingParams())  # greedy now: only b draws
    _, fourth = step(6)
    assert fourth.rows.tolist() == [2] and fourth.temperature.tolist() == pytest.approx([0.5])
