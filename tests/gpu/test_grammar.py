"""Structured outputs through the engine on the tiny random model: whatever the weights want, the output
follows the grammar and ends by itself."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from gpu.engine import Engine, EngineRequest, RequestOutput
from gpu.engine_types import GrammarSpec
from gpu.grammar import DEAD_END, GrammarError
from scheduler.types import FinishReason, SamplingParams
from tests.gpu.factories import greedy, make_engine, make_prompts

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "floor": {"type": "integer", "minimum": -3, "maximum": 200},
            },
            "required": ["lat", "floor"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "home", "active"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["positive", "negative", "neutral", 'quo"te\\ and ünïcode']
MAX_TOKENS = 300  # far more than any of these grammars can take: a LENGTH finish is a failure


def schema_spec(schema: dict = PERSON) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def sampled(seed: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=seed)


def run(engine: Engine, requests: list[EngineRequest]) -> dict[str, tuple[str, list[int], RequestOutput]]:
    """request id -> (text, tokens, last output)"""
    for request in requests:
        engine.add_request(request)
    texts: dict[str, list[str]] = {r.request_id: [] for r in requests}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id].append(out.text_delta)
            tokens[out.request_id] += out.new_token_ids
            last[out.request_id] = out
    return {i: ("".join(texts[i]), tokens[i], last[i]) for i in texts}


def constrained(grammar, n: int, seed: int = 0, prefix: str = "g") -> list[EngineRequest]:
    """Half greedy, half sampled, each from its own random prompt."""
    prompts = make_prompts(n, 3, 12, seed=seed)
    return [
        EngineRequest(
            f"{prefix}{i}", p, greedy(MAX_TOKENS) if i % 2 == 0 else sampled(seed * 100 + i), grammar=grammar
        )
        for i, p in enumerate(prompts)
    ]


def assert_stopped(results: dict) -> None:
    for request_id, (text, _, last) in results.items():
        assert last.finish_reason is FinishReason.STOP, f"{request_id} ended {last.finish_reason}: {text!r}"


def test_json_schema_outputs_validate_and_end_by_themselves():
    engine = make_engine()
    results = run(engine, constrained(schema_spec(), 8))
    assert_stopped(results)
    for text, _, _ in results.values():
        jsonschema.validate(json.loads(text), PERSON)
    assert not engine._matchers  # released with their sequences


def test_regex_and_choice_outputs_match():
    engine = make_engine()
    regex = constrained(GrammarSpec("regex", EMAIL), 4, seed=1, prefix="re")
    choice = constrained(GrammarSpec("choice", json.dumps(CHOICES)), 4, seed=2, prefix="ch")
    results = run(engine, regex + choice)
    assert_stopped(results)
    for request_id, (text, _, _) in results.items():
        if request_id.startswith("re"):
            assert re.fullmatch(EMAIL, text), text
        else:
            assert text in CHOICES, text


def test_json_object_outputs_are_objects():
    engine = make_engine()
    results = run(engine, constrained(GrammarSpec("json_object"), 4, seed=3))
    for text, _, last in results.values():
        if last.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(text), dict), text
        else:  # free-form JSON may legitimately run long on random weights; what came must be a prefix
            assert last.finish_reason is FinishReason.LENGTH and text.startswith("{"), text
    assert any(last.finish_reason is FinishReason.STOP for _, _, last in results.values())


def test_free_requests_are_unchanged_by_constrained_ones_in_their_batch():
    prompts = make_prompts(4, 5, 15, seed=4)
    free = [
        EngineRequest(f"f{i}", p, greedy(24) if i % 2 else sampled(i, max_tokens=24))
        for i, p in enumerate(prompts)
    ]
    alone = run(make_engine(), free)
    mixed = run(make_engine(), free + constrained(schema_spec(), 4, seed=5))
    for request in free:
        assert mixed[request.request_id][1] == alone[request.request_id][1]
    for request_id, (text, _, _) in mixed.items():
        if request_id.startswith("g"):
            jsonschema.validate(json.loads(text), PERSON)


def test_preemption_keeps_matcher_state_valid():
    """Preemption recomputes the KV cache but keeps the generated tokens, so each matcher stays where it
    was; outputs are those of a run without preemption, and valid."""
    requests = [
        EngineRequest(r.request_id, r.prompt_token_ids, greedy(200), grammar=r.grammar)
        for r in constrained(schema_spec(), 5, seed=7)
    ]
    roomy = run(make_engine(block_size=4), requests)
    # 240 tokens of cache; each output is about 120 tokens: sequences are preempted as they grow
    tight = make_engine(block_size=4, num_blocks=60, max_num_batched_tokens=16)
    squeezed = run(tight, requests)
    assert tight.stats().preemptions > 0
    assert_stopped(squeezed)
    for request in requests:
        text, tokens, _ = squeezed[request.request_id]
        assert tokens == roomy[request.request_id][1]
        jsonschema.validate(json.loads(text), PERSON)


def test_grammar_ends_the_sequence_when_eos_is_ignored():
    """With ignore_eos the scheduler does not stop at EOS, but EOS is only allowed once the grammar is
    complete, and accepting it terminates the grammar: the sequence still ends, with STOP."""
    engine = make_engine()
    spec = GrammarSpec("choice", json.dumps(["yes", "no"]))
    request = EngineRequest(
        "r", make_prompts(1, 4, 8, seed=8)[0], SamplingParams(max_tokens=50, ignore_eos=True), grammar=spec
    )
    text, tokens, last = run(engine, [request])["r"]
    assert text in ("yes", "no") and last.finish_reason is FinishReason.STOP
    assert tokens[-1] in engine.eos_token_ids and len(tokens) == len(text) + 1


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (GrammarSpec("json_schema", '{"type": "strin"}'), "json_schema"),
        (GrammarSpec("json_schema", '{"type": "object", "properties": '), "not valid JSON"),
        (GrammarSpec("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), "minimum"),
        (GrammarSpec("regex", "(ab"), "parenthesis"),
        (GrammarSpec("regex", r"(a)\1"), "Backreference"),
        (GrammarSpec("choice", '"yes"'), "list of strings"),
        (GrammarSpec("choice", "[]"), "list of strings"),
        (GrammarSpec("yaml", "x"), "unknown grammar kind"),
        (GrammarSpec("regex", "[^\\x00-\\U0010FFFF]"), "allows no output at all"),
    ],
)
def test_invalid_grammars_are_refused_with_a_reason_and_nothing_added(spec, words):
    engine = make_engine()
    with pytest.raises(GrammarError, match=re.escape(words)) as caught:
        engine.add_request(EngineRequest("bad", (5, 6, 7), greedy(8), grammar=spec))
    assert ".cc:" not in str(caught.value)  # no C++ source location in what the job's author reads
    assert not engine.has_unfinished() and not engine._matchers
    engine.add_request(EngineRequest("bad", (5, 6, 7), greedy(4)))  # the id was never taken


def test_compiled_on_another_thread_and_reused():
    engine = make_engine()
    compiled: list = []
    thread = threading.Thread(target=lambda: compiled.append(engine.compile_grammar(schema_spec())))
    thread.start()
    thread.join()
    assert engine.compile_grammar(schema_spec()) is compiled[0]  # cached by spec
    requests = [
        EngineRequest(r.request_id, r.prompt_token_ids, r.sampling, grammar=compiled[0])
        for r in constrained(None, 2, seed=9)
    ]
    results = run(engine, requests)
    assert_stopped(results)
    for text, _, _ in results.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_a_grammar_compiled_for_another_engine_is_recompiled():
    other = make_engine().compile_grammar(GrammarSpec("choice", '["a", "b"]'))
    engine = make_engine()
    text, _, last = run(engine, [EngineRequest("r", (5, 6), greedy(10), grammar=other)])["r"]
    assert text in ("a", "b") and last.finish_reason is FinishReason.STOP


def test_abort_releases_the_matcher():
    engine = make_engine()
    engine.add_request(EngineRequest("r", (5, 6, 7), greedy(MAX_TOKENS), grammar=schema_spec()))
    engine.step()
    assert "r" in engine._matchers
    [aborted] = engine.abort_request("r")
    assert aborted.finish_reason is FinishReason.ABORT
    assert not engine._matchers


def test_every_sample_of_an_n_request_follows_the_grammar_on_its_own():
    """n = 3 sampled samples of one constrained prompt: each has its own matcher, so each output is
    valid and ends by itself, and the samples differ (their matchers do not share state)."""
    engine = make_engine()
    [prompt] = make_prompts(1, 3, 12, seed=7)
    engine.add_request(EngineRequest("n", prompt, sampled(11), n=3, grammar=schema_spec()))
    texts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    finish: dict[int, FinishReason] = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.index].append(out.text_delta)
            if out.finish_reason is not None:
                finish[out.index] = out.finish_reason
    outputs = ["".join(t) for t in texts.values()]
    for text in outputs:
        jsonschema.validate(json.loads(text), PERSON)
    assert finish == {0: FinishReason.STOP, 1: FinishReason.STOP, 2: FinishReason.STOP}
    assert len(set(outputs)) > 1
    assert not engine._matchers


@pytest.mark.slow
def test_smollm2_answers_in_the_schema_and_stops_by_itself(smollm2):
    """On the real default model a constrained answer ends with EOS where the grammar completes."""
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "city": {"type": "string"},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    tok = smollm2.tokenizer
    question = "Describe a fictional person as JSON with name, age and city."
    prompt = tuple(tok.apply_chat_template([{"role": "user", "content": question}]))
    requests = [
        EngineRequest("schema", prompt, greedy(128), grammar=schema_spec(person)),
        EngineRequest("choice", prompt, greedy(16), grammar=GrammarSpec("choice", '["fictional", "real"]')),
    ]
    results = run(make_engine(smollm2), requests)
    assert_stopped(results)
    jsonschema.validate(json.loads(results["schema"][0]), person)
    assert results["choice"][0] in ("fictional", "real")


def test_a_token_the_grammar_rejects_ends_the_sequence(monkeypatch):
    """Defence in depth: with the mask switched off, the first token off the grammar aborts the sequence
    instead of letting it run on outside the grammar."""
    engine = make_engine()
    monkeypatch.setattr(engine.runner, "_constrain", lambda *args: None)
    spec = GrammarSpec("choice", '["yes", "no"]')
    _, tokens, last = run(engine, [EngineRequest("r", (5, 6, 7), greedy(20), grammar=spec)])["r"]
    assert last.finish_reason is FinishReason.REJECTED and len(tokens) <= 2  # the refused token not output
    assert last.detail == DEAD_END
    assert not engine._matchers


@pytest.mark.parametrize("params", [greedy(20), sampled(3, 20)])
def test_a_grammar_with_no_way_on_ends_the_sequence_rejected_with_a_reason(params):
    """After its first character this regex allows nothing: the mask is empty, whatever is drawn is refused,
    and the sequence ends `rejected` saying why (not `abort`, which means a caller cancelled it), with the
    text up to there; the step, and the free sequence beside it, carry on."""
    spec = GrammarSpec("regex", "a[^\\x00-\\U0010FFFF]")
    engine = make_engine()
    requests = [
        EngineRequest("dead", (5, 6, 7), params, grammar=spec),
        EngineRequest("free", (5, 6), greedy(8)),
    ]
    results = run(engine, requests)
    text, tokens, last = results["dead"]
    assert (text, len(tokens)) == ("a", 1)
    assert last.finish_reason is FinishReason.REJECTED and last.detail == DEAD_END
    assert results["free"][2].finish_reason is FinishReason.LENGTH and len(results["free"][1]) == 8
    assert not engine._matchers and not engine.has_unfinished()
