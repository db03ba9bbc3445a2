"""Sampler: exact fast argmax, batched top-k/top-p/temperature, draws that follow the distribution, and
per-request seeds independent of batch mates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.engine import EngineRequest
from gpu.sampler import SamplingBatch, draw, fast_argmax, filter_logits, sample, step_uniforms
from scheduler.types import SamplingParams
from tests.gpu.factories import make_engine, make_prompts


def one_row(params: SamplingParams):
    return (torch.tensor([params.temperature]), torch.tensor([params.top_k]), torch.tensor([params.top_p]))


def kept(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    return torch.isfinite(filter_logits(logits[None], *one_row(params))[0]).nonzero().flatten().tolist()


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 1) -> list[int]:
    batch = SamplingBatch.build([params] * n, [seed] * n, list(range(n)))
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
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])
    filtered = filter_logits(
        logits, torch.tensor([1.0, 1.0, 0.5]), torch.tensor([1, 0, 2]), torch.tensor([1.0, 0.5, 1.0])
    )
    assert torch.isfinite(filtered).tolist() == [
        [False, True, False, False],
        [False, True, False, False],  # top-p 0.5: the 3.0 token alone holds over half the mass
        [False, True, False, True],
    ]
    assert filtered[2, 1].item() == pytest.approx(6.0)  # temperature 0.5 doubles the logits


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 8000
    counts = np.bincount(draws(probs.log(), SamplingParams(temperature=1.0), n, seed=7), minlength=4)
    expected = probs.numpy() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


def test_zero_probability_tokens_are_never_drawn():
    logits = torch.full((2, 50), float("-inf"))
    logits[:, 17] = 0.0
    logits[1, 49] = 0.0
    u = torch.tensor([0.999999, 0.999999], dtype=torch.float64)
    assert draw(logits, u).tolist() == [17, 49]
    assert draw(logits, torch.zeros(2, dtype=torch.float64)).tolist() == [17, 17]


def test_uniforms_depend_only_on_seed_and_position():
    a = step_uniforms(np.array([5, 5, 6], dtype=np.uint64), np.array([0, 1, 0]))
    b = step_uniforms(np.array([6, 5], dtype=np.uint64), np.array([0, 1]))
    assert a[2] == b[0] and a[1] == b[1] and len(set(a.tolist())) == 3
    assert ((a >= 0) & (a < 1)).all()


def test_greedy_rows_are_argmax_beside_sampling_rows():
    torch.manual_seed(3)
    logits = torch.randn(4, 100)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(),
        SamplingParams(temperature=0.5),
    ]
    tokens = sample(logits, SamplingBatch.build(params, [1, 2, 3, 4], [0, 0, 0, 0])).tolist()
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


def test_an_argmax_computed_on_the_device_gives_the_same_tokens_and_is_never_written_into():
    """The CUDA graphs return each row's argmax with the logits: sampling rows still draw, greedy rows take
    it as is, and the graph's output buffer keeps its values (the next replay owns it)."""
    torch.manual_seed(4)
    logits = torch.randn(4, 100)
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(top_k=3)]
    batch = SamplingBatch.build(params, [1, 2, 3, 4], [0, 5, 0, 7])
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
