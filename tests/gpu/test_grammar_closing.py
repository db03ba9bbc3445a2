"""JSON outputs close before their budget runs out: the closing tokens, the string tracking, the restriction
of a row's logits, and through the engine on the tiny random model (whose greedy output loops inside an
unbounded array until max_tokens unless it is closed)."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
import torch

from gpu.engine import EngineRequest
from gpu.engine_types import GrammarSpec
from gpu.grammar import closing
from gpu.grammar.closing import Closing, closing_token_ids, closing_window
from gpu.grammar.mask import TokenMask
from gpu.tokenizer import BYTE_OFFSET
from scheduler.types import FinishReason
from tests.gpu.factories import greedy, make_engine, make_prompts
from tests.gpu.test_grammar import run

VOCAB = [b"", b'"', b'"]', b"]}", b']"', b'a"', b"}", b"]", b"x", b'"}]', b'\\"', b"\\", b'{"k": "']
NEG = float("-inf")


def test_closing_tokens_end_a_string_or_structures_and_never_open_one():
    in_string, outside = closing_token_ids(VOCAB)
    assert [VOCAB[i] for i in in_string.tolist()] == [b'"', b'"]', b'"}]']
    assert [VOCAB[i] for i in outside.tolist()] == [b"]}", b"}", b"]"]


def test_the_window_is_a_quarter_of_a_small_budget_and_at_most_64_tokens():
    assert [closing_window(n) for n in (0, 3, 16, 100, 256, 4000)] == [0, 0, 4, 25, 64, 64]


def test_strings_are_followed_through_escaped_quotes():
    tracker = Closing()
    tracker.set_vocabulary(VOCAB)
    tracker.add("s")
    states = []
    for token in (VOCAB.index(b'{"k": "'), VOCAB.index(b"\\"), VOCAB.index(b'"'), VOCAB.index(b"x")):
        tracker.accept("s", token)
        states.append(tracker.sequences["s"][0])
    # opens a string; a backslash; the quote it escapes stays inside; still inside
    assert states == [True, True, True, True]
    tracker.accept("s", VOCAB.index(b'"]'))
    assert tracker.sequences["s"] == [False, False]


def test_restrict_keeps_only_the_allowed_closing_tokens_of_due_rows():
    tracker = Closing()
    tracker.set_vocabulary(VOCAB)
    tracker.add("in")  # inside a string
    tracker.sequences["in"][0] = True
    tracker.add("out")
    tracker.add("stuck")
    logits = torch.arange(3 * len(VOCAB), dtype=torch.float32).reshape(3, len(VOCAB))
    logits[2, [VOCAB.index(t) for t in (b"]}", b"}", b"]")]] = NEG  # its grammar allows no closer
    before = logits.clone()
    tracker.restrict(logits, [(0, "in", None), (1, "out", None), (2, "stuck", None)])
    allowed = [{VOCAB[i] for i in torch.isfinite(row).nonzero().flatten().tolist()} for row in logits]
    assert allowed[0] == {b'"', b'"]', b'"}]'} and allowed[1] == {b"]}", b"}", b"]"}
    assert torch.equal(logits[0, 1], before[0, 1])  # kept logits keep their values
    assert torch.equal(logits[2], before[2])  # nothing to close with: the row is left alone


def test_due_only_in_a_json_sequences_last_tokens():
    tracker = Closing()
    tracker.set_vocabulary(VOCAB)
    tracker.add("j")
    assert not tracker.due("j", 400, 335) and tracker.due("j", 400, 336)
    assert not tracker.due("other", 400, 399)


UNBOUNDED = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}}, "done": {"type": "boolean"}},
    "required": ["items", "done"],
    "additionalProperties": False,
}


def _greedy_schema_run(max_tokens: int) -> list[tuple[str, int, object]]:
    """(text, tokens, finish reason) of six greedy requests under UNBOUNDED."""
    engine = make_engine()
    spec = GrammarSpec("json_schema", json.dumps(UNBOUNDED))
    prompts = make_prompts(6, 3, 12, seed=7)
    requests = [EngineRequest(f"u{i}", p, greedy(max_tokens), grammar=spec) for i, p in enumerate(prompts)]
    return [(text, len(tokens), last.finish_reason) for text, tokens, last in run(engine, requests).values()]


def test_json_outputs_that_would_run_past_their_budget_close_in_time(monkeypatch):
    max_tokens = 200  # the tiny model spells one byte a token: its closing takes ~20
    closed = _greedy_schema_run(max_tokens)
    for text, _, finish in closed:
        assert finish is FinishReason.STOP, text
        jsonschema.validate(json.loads(text), UNBOUNDED)
    monkeypatch.setattr(closing, "MAX_CLOSING_TOKENS", 0)  # closing off: the same requests run out
    cut = _greedy_schema_run(max_tokens)
    assert any(finish is FinishReason.LENGTH for _, _, finish in cut)
    # an output that ended before its budget's last tokens is the same either way
    last_free = max_tokens - closing_window(max_tokens)
    for free, run_out in zip(closed, cut, strict=True):
        if run_out[2] is FinishReason.STOP and run_out[1] <= last_free:
            assert free == run_out


@pytest.mark.parametrize("kind", ["regex", "choice"])
def test_other_constraints_are_never_closed(kind):
    engine = make_engine()
    spec = (
        GrammarSpec("regex", r"\[[a-z\]]{1,40}\]")
        if kind == "regex"
        else GrammarSpec("choice", '["a]", "b"]')
    )
    engine.add_request(EngineRequest("r", make_prompts(1, 3, 8, seed=1)[0], greedy(8), grammar=spec))
    assert not engine._constraints.closing.sequences
    while engine.has_unfinished():
        engine.step()


TIME = {
    "type": "object",
    "properties": {"at": {"type": "string", "format": "time"}},
    "required": ["at"],
    "additionalProperties": False,
}


def test_a_string_that_may_not_end_yet_keeps_the_tokens_after_which_it_may():
    """A time's fraction digits go on until a `Z` or an offset: of the allowed tokens only `Z` lets the
    string end next, so it alone is kept, whatever the digits' logits; the matcher is left as it was."""
    from tests.gpu.test_grammar_compiler import byte_compiler, byte_ids

    compiler = byte_compiler()
    matcher = compiler.compile(GrammarSpec("json_schema", json.dumps(TIME["properties"]["at"]))).matcher()
    tracker = Closing()
    tracker.set_vocabulary(compiler.info.decoded_vocab)
    tracker.add("t")
    for token in byte_ids('"20:00:00.000'):
        assert matcher.accept_token(token)
        tracker.accept("t", token)
    assert tracker.sequences["t"][0]  # inside the string
    mask = TokenMask(300, 1)
    logits = torch.zeros(1, 300)
    logits[0, byte_ids("0")] = 10.0  # the loop's favourite
    mask.apply(logits, mask.fill([(0, matcher)]))
    assert (
        torch.isfinite(logits[0, byte_ids("0+-Z")]).all()
        and not torch.isfinite(logits[0, byte_ids('"')]).any()
    )
    tracker.restrict(logits, [(0, "t", matcher)])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == byte_ids("Z")
    assert matcher.accept_token(byte_ids("5")[0])  # rolled back: still in the fraction


COUNTER = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^[0-9]+Z$"}},
    "required": ["code"],
    "additionalProperties": False,
}


def _counter_run(max_tokens: int) -> tuple[str, object]:
    """A greedy request under COUNTER whose bias makes the tiny model write its digits forever."""
    engine = make_engine()
    sampling = dataclasses.replace(greedy(max_tokens), logit_bias=((BYTE_OFFSET + ord("0"), 100.0),))
    spec = GrammarSpec("json_schema", json.dumps(COUNTER))
    request = EngineRequest("c", make_prompts(1, 3, 8, seed=2)[0], sampling, grammar=spec)
    text, _, last = run(engine, [request])["c"]
    return text, last.finish_reason


def test_a_pattern_whose_digits_would_run_on_ends_with_its_last_piece_and_closes(monkeypatch):
    text, finish = _counter_run(60)
    assert finish is FinishReason.STOP, text
    jsonschema.validate(json.loads(text), COUNTER)
    assert text.endswith('0Z"}')
    monkeypatch.setattr(closing, "BRIDGE_CANDIDATES", 0)  # no bridging: the digits run out the budget
    text, finish = _counter_run(60)
    assert finish is FinishReason.LENGTH, text
