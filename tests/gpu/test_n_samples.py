"""n > 1 samples of one prompt in the engine: prefilled once, KV blocks shared, one seed stream per sample."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from gpu.engine import Engine, EngineConfig, EngineRequest
from gpu.samples import sample_seed
from scheduler.types import FinishReason, SamplingParams
from tests.gpu.factories import assert_matches_hf, greedy, make_engine, make_model, make_prompts
from tests.gpu.test_cuda_device import on_cuda
from tests.gpu.test_cuda_path import cuda_path_engine

PROMPT = make_prompts(1, 40, 40, seed=21)[0]  # 40 tokens: 2 full blocks of 16 shared, a tail of 8 each
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=1234)


def run(engine, requests):
    """Step to completion; every RequestOutput per (request id, sample index), and the peak of KV blocks."""
    for r in requests:
        engine.add_request(r)
    outs: dict[tuple[str, int], list] = {}
    peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault((out.request_id, out.index), []).append(out)
        peak = max(peak, engine.stats().kv_blocks_used)
    return outs, peak


def tokens(outs, request_id: str, index: int) -> list[int]:
    return [t for o in outs[(request_id, index)] for t in o.new_token_ids]


def test_four_samples_are_reproducible_distinct_and_end_each_on_their_own():
    request = EngineRequest("x", PROMPT, SAMPLED, n=4)
    outs, _ = run(make_engine(), [request])
    again, _ = run(make_engine(), [request])
    assert sorted(outs) == [("x", i) for i in range(4)]
    samples = [tokens(outs, "x", i) for i in range(4)]
    assert samples == [tokens(again, "x", i) for i in range(4)]  # run to run
    assert len({tuple(s) for s in samples}) == 4  # four seed streams, not one
    for i in range(4):
        last = outs[("x", i)][-1]
        assert last.finish_reason is FinishReason.LENGTH and last.completion_tokens == 8
        assert all(o.finish_reason is None for o in outs[("x", i)][:-1])
        assert all(o.prompt_tokens == len(PROMPT) for o in outs[("x", i)])  # the prompt, once
        assert outs[("x", i)][0].started


def test_samples_do_not_depend_on_batch_companions():
    alone, _ = run(make_engine(), [EngineRequest("x", PROMPT, SAMPLED, n=4)])
    mates = [
        EngineRequest(f"m{i}", p, SamplingParams(max_tokens=10, temperature=0.8, seed=i), n=1 + i % 3)
        for i, p in enumerate(make_prompts(4, 3, 50, seed=22))
    ]
    crowded, _ = run(
        make_engine(max_num_batched_tokens=48),
        [*mates[:2], EngineRequest("x", PROMPT, SAMPLED, n=4), *mates[2:]],
    )
    assert [tokens(crowded, "x", i) for i in range(4)] == [tokens(alone, "x", i) for i in range(4)]


def test_sample_zero_is_the_n_equals_one_run_and_sample_i_a_derived_seed():
    group, _ = run(make_engine(), [EngineRequest("x", PROMPT, SAMPLED, n=3)])
    single, _ = run(make_engine(), [EngineRequest("x", PROMPT, SAMPLED)])
    assert tokens(group, "x", 0) == tokens(single, "x", 0)
    reseeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=sample_seed(1234, 2))
    sample2, _ = run(make_engine(), [EngineRequest("y", PROMPT, reseeded)])
    assert tokens(group, "x", 2) == tokens(sample2, "y", 0)


def test_greedy_samples_are_identical_and_equal_hf():
    model = make_model()
    outs, _ = run(make_engine(model), [EngineRequest("g", PROMPT, greedy(12), n=2)])
    first, second = tokens(outs, "g", 0), tokens(outs, "g", 1)
    assert first == second
    assert_matches_hf(model, PROMPT, first, 12)


def test_prompt_is_prefilled_once_and_its_blocks_are_shared():
    engine = make_engine(enable_prefix_caching=False)  # sharing must not depend on the prefix cache
    _, peak = run(engine, [EngineRequest("x", PROMPT, SAMPLED, n=4)])
    stats = engine.stats()
    # 40 prompt tokens once, then each of the 3 forks computes only its 8-token tail.
    assert stats.prompt_tokens_computed == 40 + 3 * 8
    # 47 tokens per sample need 3 blocks of 16: the 2 shared prompt blocks, plus one own block each
    # (6 blocks), where 4 independent requests would hold 12.
    assert peak == 2 + 4 and stats.kv_blocks_used == 0


def test_abort_ends_every_sample_once():
    engine = make_engine(enable_prefix_caching=False)
    engine.add_request(
        EngineRequest("x", PROMPT, SamplingParams(max_tokens=50, temperature=1.0, seed=5), n=4)
    )
    engine.add_request(EngineRequest("b", make_prompts(1, 10, 10, seed=3)[0], greedy(6)))
    for _ in range(3):
        engine.step()
    assert sorted(engine.running_ids()) == ["b", "x"]  # request ids, each once
    ended = engine.abort_request("x")
    assert [(o.request_id, o.index, o.finish_reason) for o in ended] == [
        ("x", i, FinishReason.ABORT) for i in range(4)
    ]
    assert engine.abort_request("x") == []
    while engine.has_unfinished():
        assert all(o.request_id != "x" for o in engine.step())
    assert engine.stats().kv_blocks_used == 0


def test_preempted_samples_recompute_to_the_same_tokens():
    """A cache too small for every sample at once: samples are preempted and recomputed (their shared
    prompt blocks kept while a sibling holds them), and still draw exactly what they draw unhindered."""
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=77)
    roomy, _ = run(make_engine(), [EngineRequest("x", PROMPT, params, n=4)])
    engine = make_engine(num_blocks=8, enable_prefix_caching=False)
    tight, _ = run(engine, [EngineRequest("x", PROMPT, params, n=4)])
    assert engine.stats().preemptions > 0
    assert [tokens(tight, "x", i) for i in range(4)] == [tokens(roomy, "x", i) for i in range(4)]


def test_a_step_run_alone_runs_every_sample_of_the_request():
    engine = make_engine()
    engine.add_request(EngineRequest("x", PROMPT, greedy(10), n=3))
    engine.add_request(EngineRequest("b", make_prompts(1, 10, 10, seed=3)[0], greedy(10)))
    engine.step()
    engine.step()
    outs = engine.step(only="x")
    assert sorted(o.index for o in outs) == [0, 1, 2] and {o.request_id for o in outs} == {"x"}
    assert engine.last_step == ("x",)


def test_samples_through_the_cuda_step_logic_share_blocks_and_match_hf():
    """The CUDA step's decode buffers (run on the CPU): seats whose tables share blocks, greedy = HF."""
    model = make_model()
    engine = cuda_path_engine(model, enable_prefix_caching=False)
    outs, peak = run(engine, [EngineRequest("g", PROMPT, greedy(8), n=3)])
    samples = [tokens(outs, "g", i) for i in range(3)]
    assert samples[0] == samples[1] == samples[2] and peak == 2 + 3
    assert_matches_hf(model, PROMPT, samples[0], 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="this machine has no CUDA device")
def test_samples_on_cuda_are_reproducible_and_greedy_ones_match_hf():
    model = on_cuda(make_model())
    runs = []
    for _ in range(2):
        outs, _ = run(Engine(model, EngineConfig(num_blocks=64)), [EngineRequest("x", PROMPT, SAMPLED, n=4)])
        runs.append([tokens(outs, "x", i) for i in range(4)])
    assert runs[0] == runs[1] and len({tuple(t) for t in runs[0]}) == 4
    engine = Engine(model, EngineConfig(num_blocks=64, enable_prefix_caching=False))
    outs, peak = run(engine, [EngineRequest("g", PROMPT, greedy(8), n=2)])
    assert tokens(outs, "g", 0) == tokens(outs, "g", 1) and peak == 2 + 2
    assert_matches_hf(model, PROMPT, tokens(outs, "g", 0), 8)


def test_rejection_and_expiry_end_every_sample():
    engine = make_engine(block_size=4, num_blocks=4)
    engine.add_request(EngineRequest("big", tuple(range(3, 40)), greedy(4), n=3))
    outs = engine.step()
    assert [(o.request_id, o.index, o.finish_reason) for o in outs] == [
        ("big", i, FinishReason.REJECTED) for i in range(3)
    ]
    assert all("KV blocks" in o.detail for o in outs)
    engine = make_engine()
    engine.add_request(EngineRequest("late", PROMPT, greedy(5), n=2, deadline=time.monotonic() - 1))
    outs = engine.step()
    assert sorted((o.request_id, o.index, o.finish_reason) for o in outs) == [
        ("late", 0, FinishReason.EXPIRED),
        ("late", 1, FinishReason.EXPIRED),
    ]
    assert not engine.has_unfinished() and engine.stats().steps == 0


def test_each_sample_has_its_own_penalty_history_and_logprobs():
    """Sample i with penalties and logprobs draws as an n = 1 request seeded sample_seed(s, i): its token
    history (for the penalties) and its logprobs are its own."""
    params = SamplingParams(
        max_tokens=12, temperature=1.0, seed=9, frequency_penalty=0.8, presence_penalty=0.3, logprobs=2
    )
    outs, _ = run(make_engine(), [EngineRequest("x", PROMPT, params, n=3)])
    for i in range(3):
        alone = dataclasses.replace(params, seed=sample_seed(9, i))
        single, _ = run(make_engine(), [EngineRequest("y", PROMPT, alone)])
        assert tokens(outs, "x", i) == tokens(single, "y", 0)
        for out in outs[("x", i)]:
            assert [lp.token_id for lp in out.logprobs] == list(out.new_token_ids)
            assert len(out.logprobs) == len(out.new_token_ids)


def test_greedy_samples_of_a_model_windowed_on_every_layer_equal_hf():
    # the prompt's blocks stay until every sample has forked; then each gives back what leaves its window
    model = make_model(seed=11, arch="mistral", sliding_window=8)
    engine = make_engine(model, block_size=4, max_num_batched_tokens=12, max_num_seqs=3)
    outs, peak = run(engine, [EngineRequest("w", PROMPT, greedy(24), n=3)])
    for index in range(3):
        assert_matches_hf(model, PROMPT, tokens(outs, "w", index), 24)
    assert peak <= 40 // 4 + 3 * 4 and engine.stats().kv_blocks_used == 0
