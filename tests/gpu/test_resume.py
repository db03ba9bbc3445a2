"""Resumed requests (EngineRequest.resume): a fresh engine given the first k tokens of a run goes on to give
exactly the rest of it (tokens, text, finish reason, usage, logprobs), whatever k."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest

from gpu.engine import Engine, EngineRequest, RequestOutput
from gpu.engine_types import GrammarSpec, ResumeRefused, TokenLogprob
from scheduler.types import FinishReason, SamplingParams
from tests.gpu.factories import greedy, make_engine, make_prompts

PROMPT = make_prompts(1, 21, 21, seed=42)[0]
SAMPLED = SamplingParams(
    max_tokens=40,
    temperature=0.9,
    top_p=0.9,
    top_k=40,
    seed=77,
    presence_penalty=0.4,
    frequency_penalty=0.3,
    repetition_penalty=1.3,
    ignore_eos=True,
)
BREAKS = (1, 2, 5, 16, 17, 39, 40)  # a block's edge (16), the last token but one, the last


@dataclass
class Stream:
    """One sample's outputs joined, as a consumer of the engine sees them."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: FinishReason | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    resumed: list[bool] = field(default_factory=list)  # per output that carried tokens

    def add(self, out: RequestOutput) -> None:
        assert self.finish is None, "an output after the last one"
        self.tokens += out.new_token_ids
        self.text += out.text_delta
        self.logprobs += out.logprobs
        if out.new_token_ids:
            self.resumed.append(out.resumed)
            assert out.completion_tokens == len(self.tokens)
        self.finish = out.finish_reason
        self.completion_tokens, self.prompt_tokens = out.completion_tokens, out.prompt_tokens


def run(request: EngineRequest, engine: Engine | None = None) -> list[Stream]:
    """Each sample's stream (by index) of the request run to its end."""
    engine = engine or make_engine()
    engine.add_request(request)
    streams = [Stream() for _ in range(max(request.n, 1))]
    while engine.has_unfinished():
        for out in engine.step():
            streams[out.index].add(out)
    return streams


def resumed(request: EngineRequest, whole: list[Stream], k: int | tuple[int, ...]) -> EngineRequest:
    """The request resumed from the first k tokens of each sample (k per sample for a tuple)."""
    ks = k if isinstance(k, tuple) else (k,) * len(whole)
    return dataclasses.replace(
        request, resume=tuple(tuple(s.tokens[:n]) for s, n in zip(whole, ks, strict=True))
    )


def check_equal(whole: Stream, part: Stream, saved: int) -> None:
    assert part.tokens == whole.tokens
    assert part.text == whole.text
    assert part.finish is whole.finish
    assert (part.completion_tokens, part.prompt_tokens) == (whole.completion_tokens, whole.prompt_tokens)
    if saved:  # the saved tokens came out at once, on the first output with tokens
        assert part.resumed[0] and not any(part.resumed[1:])
    else:
        assert not any(part.resumed)
    assert len(part.logprobs) == len(whole.logprobs)
    for a, b in zip(whole.logprobs, part.logprobs, strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def check_resumes(request: EngineRequest, breaks=BREAKS, **engine: object) -> list[Stream]:
    whole = run(request, make_engine(**engine))
    assert all(s.tokens for s in whole)
    for k in breaks:
        if k > min(len(s.tokens) for s in whole):
            continue
        part = run(resumed(request, whole, k), make_engine(**engine))
        for w, p in zip(whole, part, strict=True):
            check_equal(w, p, k)
    return whole


def test_greedy_resumes_to_the_same_output():
    whole = check_resumes(EngineRequest("g", PROMPT, greedy(40, ignore_eos=True)))
    assert whole[0].finish is FinishReason.LENGTH and len(whole[0].tokens) == 40


def test_seeded_sampling_with_penalties_resumes_to_the_same_output():
    whole = check_resumes(EngineRequest("s", PROMPT, SAMPLED))
    greedy_run = run(EngineRequest("g", PROMPT, greedy(40, ignore_eos=True)))
    assert whole[0].tokens != greedy_run[0].tokens  # it really samples


def test_logprobs_of_the_saved_tokens_are_recomputed_as_they_were():
    request = EngineRequest("l", PROMPT, dataclasses.replace(SAMPLED, logprobs=3, logit_bias=((7, 2.0),)))
    whole = check_resumes(request)
    assert len(whole[0].logprobs) == 40 and all(len(lp.top) == 3 for lp in whole[0].logprobs)


def test_logprobs_over_chunked_prefill_and_cached_blocks():
    """A resuming prefill split over steps, and a prompt whose blocks are in the prefix cache: every saved
    position still runs through the model (no cache serves them) and gives its logprob."""
    request = EngineRequest("c", PROMPT, greedy(40, ignore_eos=True, logprobs=1))
    whole = run(request)
    engine = make_engine(max_num_batched_tokens=8, max_num_seqs=8)
    for k in (30, 30, 12):  # the second run finds the first one's blocks cached
        part = run(dataclasses.replace(resumed(request, whole, k), request_id=f"c{k}"), engine)
        check_equal(whole[0], part[0], k)
    assert engine.stats().prefix_cache_hits > 0


def test_two_samples_resume_each_from_its_own_tokens():
    request = EngineRequest("n", PROMPT, dataclasses.replace(SAMPLED, logprobs=1), n=2)
    whole = run(request)
    assert whole[0].tokens != whole[1].tokens
    for ks in ((3, 20), (40, 1), (0, 17), (17,)):
        part = run(resumed(request, whole, ks + (0,) * (2 - len(ks))))
        for w, p, k in zip(whole, part, ks + (0,), strict=False):
            check_equal(w, p, k)


def test_a_sample_resumed_complete_ends_on_the_resuming_step():
    """Its saved tokens end with EOS: nothing more is generated, the finish is STOP, as it was."""
    engine = make_engine()
    eos = min(engine.eos_token_ids)
    request = EngineRequest("e", PROMPT, greedy(40, logit_bias=((eos, 8.0),)))
    whole = run(request)
    assert whole[0].finish is FinishReason.STOP and whole[0].tokens[-1] == eos
    part = run(resumed(request, whole, len(whole[0].tokens)))
    check_equal(whole[0], part[0], len(whole[0].tokens))


def stop_string_across(whole: Stream, at: int) -> str:
    """A stop string from the text of tokens at-2 .. at+1 (the byte tokenizer: a token is a byte), found
    nowhere earlier in the text."""
    text = whole.text
    for start in range(at - 2, 0, -1):
        stop = text[start : at + 2]
        if stop.isprintable() and text.find(stop) == start:
            return stop
    raise AssertionError("no stop string to be had from this text")


def test_a_stop_string_straddling_the_break_is_found():
    base = EngineRequest("t", PROMPT, greedy(40, ignore_eos=True))
    first = run(base)[0]
    stop = stop_string_across(first, 20)
    request = dataclasses.replace(base, stop=(stop,))
    whole = run(request)
    assert whole[0].finish is FinishReason.STOP and stop not in whole[0].text
    end = len(whole[0].tokens)
    for k in range(end - len(stop.encode()) - 1, end + 1):  # every break inside the stop string and about it
        check_equal(whole[0], run(resumed(request, whole, k))[0], k)


def test_a_multibyte_character_straddling_the_break_comes_out_once():
    text = "héllo wörld ✓ ü"
    request = EngineRequest("u", PROMPT, greedy(60), grammar=GrammarSpec("choice", json.dumps([text])))
    whole = run(request)
    assert whole[0].text == text
    for k in range(1, len(whole[0].tokens) + 1):
        part = run(resumed(request, whole, k))[0]
        check_equal(whole[0], part, k)
        assert "\ufffd" not in part.text


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "n": {"type": "integer"},
    },
    "required": ["name", "tags", "n"],
    "additionalProperties": False,
}


def test_a_json_schema_job_resumes_inside_its_structure():
    sampling = SamplingParams(max_tokens=48, temperature=1.0, top_p=0.95, seed=5, logprobs=2)
    request = EngineRequest("j", PROMPT, sampling, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    whole = run(request)
    json.loads(whole[0].text)  # the grammar held (and closed it within its budget)
    check_resumes(request, breaks=(1, 3, 9, 20, len(whole[0].tokens) - 1, len(whole[0].tokens)))


def test_resumes_under_async_scheduling():
    request = EngineRequest(
        "a",
        PROMPT,
        dataclasses.replace(SAMPLED, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0),
    )
    check_resumes(request, breaks=(1, 9, 40), async_scheduling=True)


def test_a_resumed_sample_aborted_before_its_tokens_came_out_carries_them_on_its_last_output():
    request = EngineRequest("x", PROMPT, greedy(40, ignore_eos=True))
    whole = run(request)
    engine = make_engine()
    engine.add_request(resumed(request, whole, 10))
    out = engine.abort_request("x")
    assert len(out) == 1 and out[0].resumed and out[0].finish_reason is FinishReason.ABORT
    assert list(out[0].new_token_ids) == whole[0].tokens[:10] and out[0].completion_tokens == 10
    assert whole[0].text.startswith(out[0].text_delta) and out[0].text_delta


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (dict(resume=((5, 600),)), "outside the vocabulary"),
        (dict(resume=(tuple(range(3, 20)),), sampling=greedy(16)), "more than max_tokens"),
        (dict(resume=((5,), (6,))), "n = 1"),
        (dict(resume=((5, 2, 7),)), "stop token"),
        (dict(resume=((5,),), sampling=SamplingParams(max_tokens=8, temperature=1.0)), "seed"),
        (dict(resume=((ord("a") + 3, ord("b") + 3, 9),), stop=("ab",)), "stop string"),
        (dict(resume=((ord("x") + 3,),), grammar=GrammarSpec("regex", "[0-9]+")), "grammar rejects"),
    ],
)
def test_an_unusable_resume_is_refused_and_nothing_is_added(change, why):
    engine = make_engine()
    assert 2 in engine.eos_token_ids
    request = dataclasses.replace(EngineRequest("r", PROMPT, greedy(8)), **change)
    with pytest.raises(ResumeRefused, match=why):
        engine.add_request(request)
    assert not engine.has_unfinished()
    engine.add_request(dataclasses.replace(request, resume=()))  # afresh, under the same id
    assert run_to_end(engine)


def run_to_end(engine: Engine) -> list[RequestOutput]:
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


@pytest.mark.slow
def test_smollm2_resumes_a_chat_answer_to_the_same_text(smollm2):
    tokenizer = smollm2.tokenizer
    prompt = tuple(tokenizer.apply_chat_template([{"role": "user", "content": "Name three French cheeses."}]))
    engine_config = dict(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
    sampling = SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=3, logprobs=1)
    request = EngineRequest("sm", prompt, sampling)
    whole = run(request, make_engine(smollm2, **engine_config))
    assert len(whole[0].tokens) > 10
    part = run(resumed(request, whole, 9), make_engine(smollm2, **engine_config))
    check_equal(whole[0], part[0], 9)
