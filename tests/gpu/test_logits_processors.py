"""logit_bias and penalties, batched, against a per-row reference written straight from the definitions
(OpenAI's presence/frequency formula, HF's RepetitionPenaltyLogitsProcessor), and log probabilities; with
the counts on the host (the CPU path) and on the device (gpu/penalty_counts.py, the CUDA path: run here on
CPU tensors), which give the same logits to the bit."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu.logits_processors import LogitsState, apply, count_sampled, fast_topk, token_logprobs
from gpu.sampler import fast_argmax
from scheduler.output import ScheduledChunk
from scheduler.types import SamplingParams

VOCAB = 40


def reference(
    logits: torch.Tensor, prompt: list[int], generated: list[int], p: SamplingParams
) -> torch.Tensor:
    """One row, one token at a time, as the definitions read."""
    out = logits.clone()
    for token, bias in p.logit_bias:
        if token < len(out):  # ids outside the vocabulary are ignored
            out[token] += bias
    for token in set(prompt) | set(generated):
        value = out[token]
        out[token] = value * p.repetition_penalty if value < 0 else value / p.repetition_penalty
    for token, count in Counter(generated).items():
        out[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def chunk(seq_id: str) -> ScheduledChunk:
    return ScheduledChunk(seq_id, (0,), 0, (), True, SamplingParams(), 0)


def run_step(
    state: LogitsState, seq_ids: list[str], logits: torch.Tensor, tokens: list[int] | None = None
) -> tuple[torch.Tensor, dict]:
    """One step of the sampler's processing over the given rows; records `tokens` (default: argmax)."""
    logits = logits.clone()
    plan = state.plan([chunk(s) for s in seq_ids])
    if plan is None:
        return logits, {}
    apply(logits, plan)
    picked = torch.tensor(tokens) if tokens is not None else fast_argmax(logits)
    count_sampled(picked, plan)  # the device path's counts (nothing on the host path)
    logprobs = token_logprobs(logits, picked, plan)
    state.record(plan, picked.tolist(), logprobs)
    return logits, state.take_logprobs()


@pytest.fixture(params=[False, True], ids=["host-counts", "device-counts"])
def device_counts(request) -> bool:
    return request.param


def test_plain_requests_are_not_tracked():
    state = LogitsState(VOCAB)
    state.add("a", [1, 2], SamplingParams(temperature=0.7, top_k=5, seed=3))
    assert not state and state.plan([chunk("a")]) is None
    state.add("b", [1, 2], SamplingParams(logprobs=0))
    assert state and state.plan([chunk("a")]) is None  # b is not in the step
    state.drop("b")
    assert not state


def test_counts_follow_generated_tokens_over_steps_and_bias_ids_outside_the_vocabulary_are_ignored(
    device_counts,
):
    params = SamplingParams(
        presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((3, 2.0), (VOCAB + 5, 9.0))
    )
    state = LogitsState(VOCAB, device_counts)
    prompt = [7, 7, 9]
    state.add("a", prompt, params)
    generated: list[int] = []
    torch.manual_seed(0)
    for token in (4, 4, 11, 4, 7):
        logits = torch.randn(1, VOCAB)
        got, _ = run_step(state, ["a"], logits, [token])
        torch.testing.assert_close(got[0], reference(logits[0], prompt, generated, params), rtol=0, atol=1e-6)
        generated.append(token)
    # The prompt's 7s are not counted by presence/frequency: only the one generated 7 is.
    got, _ = run_step(state, ["a"], torch.zeros(1, VOCAB), [0])
    assert got[0, 7].item() == -0.75 and got[0, 4].item() == -1.25 and got[0, 9].item() == 0.0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens(device_counts):
    state = LogitsState(VOCAB, device_counts)
    state.add("a", [1, 2], SamplingParams(repetition_penalty=2.0))
    logits = torch.zeros(1, VOCAB)
    logits[0, 1], logits[0, 2], logits[0, 3] = 4.0, -4.0, 4.0
    got, _ = run_step(state, ["a"], logits, [3])
    assert got[0, :4].tolist() == [0.0, 2.0, -8.0, 4.0]
    got, _ = run_step(state, ["a"], logits, [0])
    assert got[0, 3].item() == 2.0  # now generated: penalised too


def test_logprobs_are_log_softmax_with_the_sampled_token_and_top_k_most_likely_first():
    state = LogitsState(VOCAB)
    state.add("a", [1], SamplingParams(logprobs=3, logit_bias=((5, 1.5),)))
    state.add("b", [1], SamplingParams(logprobs=0))
    state.add("c", [1], SamplingParams(frequency_penalty=1.0))  # no logprobs asked
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB)
    processed, logprobs = run_step(state, ["x", "a", "b", "c"], logits, [0, 9, 17, 2])
    assert set(logprobs) == {"a", "b"}
    want = torch.log_softmax(processed[1], dim=-1)
    a = logprobs["a"]
    assert a.token_id == 9 and abs(a.logprob - want[9].item()) < 1e-6
    top = torch.topk(want, 3)
    assert [t for t, _ in a.top] == top.indices.tolist()
    assert all(abs(v - w) < 1e-6 for (_, v), w in zip(a.top, top.values.tolist(), strict=True))
    assert [v for _, v in a.top] == sorted((v for _, v in a.top), reverse=True)
    assert processed[1, 5].item() == logits[1, 5].item() + 1.5  # the bias is in what logprobs see
    assert logprobs["b"].token_id == 17 and logprobs["b"].top == ()


params_strategy = st.builds(
    SamplingParams,
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0, 2.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3, -0.5, 1.5]),
    repetition_penalty=st.sampled_from([1.0, 1.2, 0.8, 2.0]),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100, width=32), max_size=4).map(
        lambda d: tuple(sorted(d.items()))
    ),
    logprobs=st.none() | st.integers(0, 5),
)
row_strategy = st.tuples(
    params_strategy,
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),  # prompt
    st.lists(st.integers(0, VOCAB - 1), max_size=12),  # generated so far
)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(row_strategy, min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_batched_processing_equals_the_per_row_reference(rows, seed):
    states = LogitsState(VOCAB), LogitsState(VOCAB, device_counts=True)
    for state in states:
        state.add("plain", [1], SamplingParams())  # in the step, untracked (every step's sequence is added)
    for i, (params, prompt, generated) in enumerate(rows):
        for state in states:
            # half of them start with their tokens (a resume), half count them a step at a time
            state.add(f"s{i}", prompt, params, generated if i % 2 else ())
        for token in () if i % 2 else generated:  # one token per step, as the engine
            for state in states:
                run_step(state, [f"s{i}"], torch.zeros(1, VOCAB), [token])
    logits = torch.randn(len(rows) + 1, VOCAB, generator=torch.Generator().manual_seed(seed))
    ids = [f"s{i}" for i in range(len(rows))]
    got, _ = run_step(states[0], ["plain", *ids], logits)
    on_device, _ = run_step(states[1], ["plain", *ids], logits)
    torch.testing.assert_close(on_device, got, rtol=0, atol=0)  # the same logits, to the bit
    torch.testing.assert_close(got[0], logits[0], rtol=0, atol=0)  # an untracked row is left alone
    for i, (params, prompt, generated) in enumerate(rows):
        want = reference(logits[i + 1], prompt, generated, params)
        torch.testing.assert_close(got[i + 1], want, rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="this machine has no CUDA device")
def test_processing_on_cuda_equals_the_cpu():
    state = LogitsState(VOCAB)
    state.add("a", [1, 2, 2], SamplingParams(presence_penalty=0.5, repetition_penalty=1.3, logprobs=4))
    state.add("b", [3], SamplingParams(frequency_penalty=0.7, logit_bias=((1, -2.0), (5, 4.0)), logprobs=0))
    for token in (2, 5, 5):
        state.record(state.plan([chunk("a"), chunk("b")]), [token, token], {})
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    plan = state.plan([chunk("a"), chunk("x"), chunk("b")])
    assert plan is not None
    cpu, cuda = logits.clone(), logits.cuda()
    on_cuda = plan.to(cuda.device)
    apply(cpu, plan)
    apply(cuda, on_cuda)
    torch.testing.assert_close(cuda.cpu(), cpu)
    tokens = torch.tensor([7, 0, 9])
    want, got = token_logprobs(cpu, tokens, plan), token_logprobs(cuda, tokens.cuda(), on_cuda)
    assert want.keys() == got.keys() == {"a", "b"}
    for seq_id, w in want.items():
        g = got[seq_id]
        assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < 1e-5
        assert [t for t, _ in g.top] == [t for t, _ in w.top]


@pytest.mark.parametrize("vocab", [49152, 32000, 1000, 300])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_fast_topk_equals_torch_topk(vocab, k):
    x = torch.log_softmax(torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab + k)), dim=-1)
    x[1, :] = x[1, 0]  # all tied
    x[2, vocab // 3] = x[2, vocab - 1] = 5.0  # a tie across blocks
    values, ids = fast_topk(x, k)
    want = torch.topk(x, k, dim=-1)
    assert torch.equal(values, want.values)
    assert torch.equal(x.gather(1, ids), values)  # the ids hold those values (order among ties may differ)
    assert all(len(set(row)) == k for row in ids.tolist())


def test_the_device_path_plans_a_repeated_step_once_and_builds_a_newcomers_counts_once():
    """A step with the last one's rows reuses its plan (no lookups); a sequence in a step for the first
    time has its count row built by that step's plan alone, never again (a rebuild would zero its counts)."""
    state = LogitsState(VOCAB, device_counts=True)
    penalised = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    state.add("a", [1, 2], penalised)
    first = state.plan([chunk("a")])
    assert first is not None and first.counted is not None and len(first.counted.fresh) == 1
    second = state.plan([chunk("a")])
    assert second is not first and not len(second.counted.fresh)
    assert state.plan([chunk("a")]) is second  # the same rows and slots: the same plan
    state.add("b", [3], penalised)  # a newcomer: a new plan, building b's row alone
    third = state.plan([chunk("a"), chunk("b")])
    assert third.counted.fresh.tolist() == [third.counted.slots.tolist()[1]]
    assert not len(state.plan([chunk("a"), chunk("b")]).counted.fresh)
    logits = torch.zeros(2, VOCAB)
    for _ in range(3):  # b generates token 5 three times: counted, never reset
        run_step(state, ["a", "b"], logits, [4, 5])
    got, _ = run_step(state, ["a", "b"], logits, [4, 5])
    assert got[1, 5].item() == pytest.approx(-(0.25 * 3 + 0.5))
    assert got[0, 4].item() == pytest.approx(-(0.25 * 3 + 0.5))
