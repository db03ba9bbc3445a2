"""Sampler: exact fast argmax, top-k/top-p support, per-request seeds independent of batch mates."""

from __future__ import annotations

import torch

from gpu.engine import EngineRequest
from gpu.sampler import fast_argmax, filter_logits, sample_row
from scheduler.types import SamplingParams
from tests.gpu.factories import make_engine, make_prompts


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
    kept = torch.isfinite(filter_logits(logits, params)).nonzero().flatten().tolist()
    assert kept == [1, 3, 5]
    drawn = {sample_row(logits, params, seed=1, num_generated=i) for i in range(200)}
    assert drawn == {1, 3, 5}


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])
    logits = probs.log()
    for top_p, want in ((0.5, [1]), (0.7, [1, 2]), (0.85, [1, 2, 3]), (0.97, [0, 1, 2, 3])):
        kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=top_p)))
        assert kept.nonzero().flatten().tolist() == want, top_p
    drawn = {sample_row(logits, SamplingParams(temperature=1.0, top_p=0.7), 3, i) for i in range(200)}
    assert drawn == {1, 2}


def test_seeded_sampling_is_reproducible_regardless_of_batch_mates():
    prompt = make_prompts(1, 20, 20, seed=11)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=1234)
    alone = make_engine().generate([EngineRequest("x", prompt, params)])["x"]
    mates = [
        EngineRequest(f"m{i}", p, SamplingParams(max_tokens=15, temperature=0.8, seed=i))
        for i, p in enumerate(make_prompts(5, 3, 40, seed=12))
    ]
    crowded = make_engine(max_num_batched_tokens=32).generate(
        [*mates[:3], EngineRequest("x", prompt, params), *mates[3:]]
    )
    assert crowded["x"] == alone
    reseeded = EngineRequest("x", prompt, SamplingParams(20, 1.0, 0.95, seed=99))
    other_seed = make_engine().generate([reseeded])["x"]
    assert other_seed != alone
