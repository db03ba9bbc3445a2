"""Penalties, logit_bias and log probabilities through the engine, against Hugging Face on the tiny model
(CPU, fp32): logprobs equal HF's log_softmax, repetition_penalty equals HF generate, presence/frequency
and bias equal a reference greedy loop over HF's logits, whatever the batch mates and preemptions."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from gpu.engine import EngineRequest
from gpu.logits_processors import LogitsState
from gpu.model import LoadedModel
from scheduler.types import SamplingParams
from tests.gpu.factories import make_engine, make_model, make_prompts

LOGPROB_TOL = 1e-4


@torch.inference_mode()
def hf_logits(model: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """HF's logits [len(tokens), V] for every position of the sequence."""
    return model.model(torch.tensor([tokens])).logits[0].float()


def run(engine, requests: list[EngineRequest]) -> dict[str, list]:
    """Every request's outputs, token by token: (token, TokenLogprob or None)."""
    for request in requests:
        engine.add_request(request)
    got: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            assert len(out.logprobs) in (0, len(out.new_token_ids))
            for i, token in enumerate(out.new_token_ids):
                got[out.request_id].append((token, out.logprobs[i] if out.logprobs else None))
    return got


def tokens_of(outputs: list) -> list[int]:
    return [t for t, _ in outputs]


@torch.inference_mode()
def reference_greedy(model: LoadedModel, prompt: tuple[int, ...], p: SamplingParams) -> list[int]:
    """Greedy decoding over HF's full-context logits with bias and OpenAI's penalties applied by hand."""
    tokens = list(prompt)
    for _ in range(p.max_tokens):
        logits = hf_logits(model, tokens)[-1]
        for token, bias in p.logit_bias:
            logits[token] += bias
        for token, count in Counter(tokens[len(prompt) :]).items():
            logits[token] -= p.frequency_penalty * count + p.presence_penalty
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def test_logprobs_equal_hf_log_softmax_with_top_alternatives_in_order():
    model = make_model()
    prompts = make_prompts(2, 6, 20, seed=21)
    requests = [
        EngineRequest("g", prompts[0], SamplingParams(max_tokens=12, logprobs=5)),
        # sampled: logprobs are taken before temperature and top-k, so they still equal HF's
        EngineRequest("s", prompts[1], SamplingParams(12, temperature=0.7, top_k=20, seed=3, logprobs=20)),
    ]
    got = run(make_engine(model, block_size=4, max_num_batched_tokens=8), requests)  # chunked prefill too
    for request in requests:
        outputs = got[request.request_id]
        assert len(outputs) == 12
        generated = tokens_of(outputs)
        want = torch.log_softmax(hf_logits(model, [*request.prompt_token_ids, *generated]), dim=-1)
        k = request.sampling.logprobs
        for i, (token, logprob) in enumerate(outputs):
            row = want[len(request.prompt_token_ids) - 1 + i]
            assert logprob.token_id == token
            assert abs(logprob.logprob - row[token].item()) < LOGPROB_TOL
            assert len(logprob.top) == k
            values = [v for _, v in logprob.top]
            assert values == sorted(values, reverse=True)
            for token_id, value in logprob.top:
                assert abs(value - row[token_id].item()) < LOGPROB_TOL
            # the top k really are the k most likely (up to ties within the tolerance)
            kth = torch.topk(row, k).values[-1].item()
            assert min(values) >= kth - LOGPROB_TOL
        if request.sampling.greedy:
            start = len(request.prompt_token_ids) - 1
            assert generated == want[start : start + 12].argmax(dim=-1).tolist()
            assert all(lp.top[0][0] == t for t, lp in outputs)


def test_logprobs_zero_gives_the_sampled_token_only_and_none_when_not_asked():
    model = make_model()
    prompt = make_prompts(1, 8, 8, seed=22)[0]
    got = run(
        make_engine(model),
        [
            EngineRequest("zero", prompt, SamplingParams(max_tokens=4, logprobs=0)),
            EngineRequest("off", prompt, SamplingParams(max_tokens=4)),
        ],
    )
    assert all(lp is not None and lp.top == () for _, lp in got["zero"])
    assert all(lp is None for _, lp in got["off"])
    assert tokens_of(got["zero"]) == tokens_of(got["off"])


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_greedy_equals_hf_generate(penalty):
    model = make_model()
    prompts = make_prompts(3, 4, 16, seed=23)
    requests = [
        EngineRequest(f"r{i}", p, SamplingParams(max_tokens=20, repetition_penalty=penalty, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    got = run(make_engine(model), requests)
    for request in requests:
        with torch.inference_mode():
            out = model.model.generate(
                torch.tensor([request.prompt_token_ids]),
                attention_mask=torch.ones(1, len(request.prompt_token_ids), dtype=torch.long),
                max_new_tokens=20,
                do_sample=False,
                repetition_penalty=penalty,
                eos_token_id=None,
                pad_token_id=0,
            )
        want = out[0, len(request.prompt_token_ids) :].tolist()
        assert tokens_of(got[request.request_id]) == want
    plain = run(make_engine(model), [EngineRequest("p", prompts[0], SamplingParams(20, ignore_eos=True))])
    assert tokens_of(plain["p"]) != tokens_of(got["r0"])  # the penalty did something


def test_presence_frequency_and_bias_equal_the_reference_greedy_loop():
    model = make_model()
    prompts = make_prompts(3, 5, 15, seed=24)
    settings = [
        SamplingParams(max_tokens=16, frequency_penalty=0.02, ignore_eos=True),
        SamplingParams(max_tokens=16, presence_penalty=0.05, frequency_penalty=-0.01, ignore_eos=True),
        SamplingParams(
            max_tokens=16, presence_penalty=0.03, logit_bias=((7, 0.05), (300, -0.02)), ignore_eos=True
        ),
    ]
    requests = [EngineRequest(f"q{i}", p, s) for i, (p, s) in enumerate(zip(prompts, settings, strict=True))]
    got = run(make_engine(model), requests)
    for request in requests:
        assert tokens_of(got[request.request_id]) == reference_greedy(
            model, request.prompt_token_ids, request.sampling
        )
    # Only generated tokens count: a prompt that ends in a loop keeps its next token under huge penalties.
    looping = (*prompts[0], *reference_greedy(model, prompts[0], SamplingParams(max_tokens=8)))
    plain = reference_greedy(model, looping, SamplingParams(max_tokens=1))[0]
    assert plain in looping  # the case worth testing: the model repeats a prompt token
    heavy = SamplingParams(max_tokens=2, presence_penalty=50.0, frequency_penalty=50.0, ignore_eos=True)
    first, second = tokens_of(run(make_engine(model), [EngineRequest("h", looping, heavy)])["h"])
    assert first == plain and second != first
    # a strong frequency penalty forbids repeating any generated token
    strong = SamplingParams(max_tokens=30, frequency_penalty=50.0, ignore_eos=True)
    tokens = tokens_of(run(make_engine(model), [EngineRequest("f", prompts[0], strong)])["f"])
    assert len(set(tokens)) == len(tokens) == 30


def test_bias_moves_the_greedy_choice():
    model = make_model()
    prompt = make_prompts(1, 10, 10, seed=25)[0]
    plain = tokens_of(run(make_engine(model), [EngineRequest("p", prompt, SamplingParams(1))])["p"])[0]
    banned = SamplingParams(1, logit_bias=((plain, -100.0),))
    assert tokens_of(run(make_engine(model), [EngineRequest("b", prompt, banned)])["b"])[0] != plain
    forced = SamplingParams(
        6, temperature=1.0, seed=5, logit_bias=((42, 100.0),), logprobs=1, ignore_eos=True
    )
    outputs = run(make_engine(model), [EngineRequest("f", prompt, forced)])["f"]
    assert tokens_of(outputs) == [42] * 6
    assert all(lp.logprob > -1e-3 and lp.top[0][0] == 42 for _, lp in outputs)  # the bias is in the logprobs


def test_a_mixed_batch_gives_each_request_what_it_gets_alone():
    model = make_model()
    prompts = make_prompts(6, 3, 30, seed=26)
    settings = [
        SamplingParams(max_tokens=14),
        SamplingParams(max_tokens=14, logprobs=3),
        SamplingParams(
            max_tokens=14, temperature=0.9, seed=11, presence_penalty=0.5, frequency_penalty=0.3, logprobs=2
        ),
        SamplingParams(max_tokens=14, repetition_penalty=1.3),
        SamplingParams(max_tokens=14, temperature=1.1, top_k=30, top_p=0.9, seed=12, logit_bias=((9, 3.0),)),
        SamplingParams(max_tokens=14, temperature=0.8, seed=13),
    ]
    requests = [EngineRequest(f"m{i}", p, s) for i, (p, s) in enumerate(zip(prompts, settings, strict=True))]
    together = run(make_engine(model, max_num_batched_tokens=24), requests)
    for request in requests:
        alone = run(make_engine(model), [request])[request.request_id]
        mixed = together[request.request_id]
        assert tokens_of(mixed) == tokens_of(alone), request.request_id
        for (_, a), (_, b) in zip(mixed, alone, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert abs(a.logprob - b.logprob) < 1e-5 and [t for t, _ in a.top] == [t for t, _ in b.top]


def test_preemption_and_recompute_keep_penalties_on_generated_tokens():
    model = make_model()
    prompts = make_prompts(5, 10, 20, seed=5)
    settings = [
        SamplingParams(max_tokens=n, presence_penalty=0.04, frequency_penalty=0.02, ignore_eos=True)
        for n in (20, 25, 15, 22, 18)
    ]
    settings[1] = SamplingParams(max_tokens=25, repetition_penalty=1.4, ignore_eos=True)
    requests = [EngineRequest(f"e{i}", p, s) for i, (p, s) in enumerate(zip(prompts, settings, strict=True))]
    engine = make_engine(model, block_size=4, num_blocks=14, max_num_batched_tokens=16)
    got = run(engine, requests)
    assert engine.stats().preemptions > 0
    for request in requests:
        alone = run(make_engine(model), [request])[request.request_id]
        assert tokens_of(got[request.request_id]) == tokens_of(alone), request.request_id
    for request in (requests[0], requests[2]):
        want = reference_greedy(model, request.prompt_token_ids, request.sampling)
        assert tokens_of(got[request.request_id]) == want
    assert not engine._logits  # every request's history is dropped when it ends


def counts_on_device(engine):
    """The engine with the CUDA path's penalty counts (gpu/penalty_counts.py), here on CPU tensors."""
    engine._logits = LogitsState(engine.model.config.vocab_size, True, engine._seeds)
    return engine


def test_counts_on_the_device_give_the_host_counts_tokens_with_preemption_n_and_resume():
    """The CUDA path's device-resident counts, run here: the same tokens and logprobs as the host's, with
    sequences preempted and recomputed (they keep their counts), two samples, and a resumed request."""
    model = make_model()
    prompts = make_prompts(5, 10, 20, seed=7)
    penalised = dict(presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.3, ignore_eos=True)
    requests = [
        EngineRequest("a", prompts[0], SamplingParams(max_tokens=20, **penalised)),
        EngineRequest("b", prompts[1], SamplingParams(max_tokens=25, temperature=0.9, seed=4, **penalised)),
        EngineRequest("c", prompts[2], SamplingParams(max_tokens=18, logprobs=2, **penalised), n=2),
        EngineRequest("d", prompts[3], SamplingParams(max_tokens=22, temperature=1.0, seed=5, **penalised)),
        EngineRequest("e", prompts[4], SamplingParams(max_tokens=15, logit_bias=((7, 2.0),), **penalised)),
    ]
    config = dict(block_size=4, num_blocks=16, max_num_batched_tokens=16)
    host = run(make_engine(model, **config), requests)
    engine = counts_on_device(make_engine(model, **config))
    device = run(engine, requests)
    assert engine.stats().preemptions > 0
    assert {k: tokens_of(v) for k, v in device.items()} == {k: tokens_of(v) for k, v in host.items()}
    for (_, a), (_, b) in zip(device["c"], host["c"], strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    resumed = dataclasses.replace(requests[1], resume=(tuple(tokens_of(host["b"])[:9]),))
    assert tokens_of(run(counts_on_device(make_engine(model)), [resumed])["b"]) == tokens_of(host["b"])
    assert engine._logits.counts is not None and engine._logits.counts.held == 0  # every slot given back
