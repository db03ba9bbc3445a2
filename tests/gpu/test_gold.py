"""Gold: greedy engine output equals HF generate run alone, token for token, in every batching regime."""

from __future__ import annotations

import copy

import pytest
import torch

from gpu.cpu.native_decode import NativeDecode
from gpu.model import load_model
from tests.gpu.factories import (
    assert_matches_hf,
    hf_greedy,
    make_engine,
    make_model,
    make_prompts,
    make_requests,
    wrap,
)

OUTPUT_LENS = [1, 24, 7, 30, 3, 16, 12, 20]


@pytest.fixture(
    params=[
        pytest.param("native", marks=pytest.mark.skipif(NativeDecode.load() is None, reason="no C compiler")),
        "torch",
    ]
)
def kernel(request) -> str:
    """Every decode attention kernel must match HF."""
    return request.param


def native(kernel: str) -> dict[str, object]:
    """Engine options: every native CPU kernel ("native") or none ("torch")."""
    return {"decode_kernel": kernel, "fused_rope": kernel == "native"}


def run_and_check(engine, model, prompts, lens, prefix="r"):
    requests = make_requests(prompts, lens, prefix)
    got = engine.generate(requests)
    for request, prompt, n in zip(requests, prompts, lens, strict=True):
        assert_matches_hf(model, prompt, got[request.request_id], n)
    return engine.stats()


def test_mixed_batch_matches_hf(kernel):
    model = make_model()
    prompts = make_prompts(8, 1, 60)
    run_and_check(make_engine(model, **native(kernel)), model, prompts, OUTPUT_LENS)


def test_default_size_model_matches_hf(kernel):
    model = load_model("tiny", "float32", "cpu", seed=0)  # the tiny built-in model, exactly as served
    prompts = make_prompts(4, 5, 40, vocab=32000, seed=1)
    run_and_check(make_engine(model, **native(kernel)), model, prompts, [12, 4, 9, 6])


def test_chunked_prefill_matches_hf(kernel):
    model = make_model()
    prompts = make_prompts(6, 10, 50, seed=2)
    stats = run_and_check(
        make_engine(model, block_size=4, max_num_batched_tokens=8, **native(kernel)),
        model,
        prompts,
        OUTPUT_LENS[:6],
    )
    assert stats.mean_batch_tokens <= 8


def test_prefix_cache_hits_match_hf(kernel):
    model = make_model()
    shared = make_prompts(1, 40, 40, seed=3)[0]
    tails = make_prompts(6, 1, 12, seed=4)
    prompts = [shared + t for t in tails]
    engine = make_engine(model, block_size=8, **native(kernel))
    run_and_check(engine, model, prompts[:3], [10, 5, 8], prefix="a")
    before = engine.stats().prefix_cache_hits
    stats = run_and_check(engine, model, prompts[3:], [6, 9, 4], prefix="b")
    assert stats.prefix_cache_hits - before >= 3 * 40 // 8 * 8


def test_forced_preemption_matches_hf(kernel):
    model = make_model()
    prompts = make_prompts(5, 10, 20, seed=5)
    engine = make_engine(model, block_size=4, num_blocks=14, max_num_batched_tokens=16, **native(kernel))
    stats = run_and_check(engine, model, prompts, [20, 25, 15, 22, 18])
    assert stats.preemptions > 0


@pytest.mark.parametrize(
    "arch",
    [
        dict(arch="qwen2"),
        dict(arch="mistral", sliding_window=None),
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ],
    ids=["qwen2", "mistral", "llama3-rope"],
)
def test_variants_match_hf(arch):
    model = make_model(seed=7, **arch)
    prompts = make_prompts(3, 5, 40, seed=6)
    run_and_check(make_engine(model), model, prompts, [10, 6, 12])


def test_gold_check_rejects_a_real_divergence():
    model = make_model()
    prompt = make_prompts(1, 12, 12, seed=9)[0]
    wrong = hf_greedy(model, prompt, 6)
    wrong[3] = (wrong[3] + 1) % model.config.vocab_size
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_matches_hf(model, prompt, wrong, 6)


def test_gold_check_accepts_divergence_at_an_exact_tie():
    model = wrap(copy.deepcopy(make_model().model))
    prompt = make_prompts(1, 12, 12, seed=9)[0]
    first = hf_greedy(model, prompt, 1)[0]
    twin = (first + 1) % model.config.vocab_size
    with torch.no_grad():  # two identical output rows: their logits tie exactly
        model.model.lm_head.weight[twin] = model.model.lm_head.weight[first]
    got = [twin, *hf_greedy(model, (*prompt, twin), 3)]
    assert_matches_hf(model, prompt, got, 4)
