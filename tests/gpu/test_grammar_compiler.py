"""The grammar compiler and the token mask on their own: vocabulary, errors, limits, the cache, applying."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from gpu.engine_types import GrammarSpec
from gpu.generation_config import eos_token_ids
from gpu.grammar import GrammarError, compiler
from gpu.grammar.compiler import GrammarCompiler
from gpu.grammar.mask import TokenMask
from gpu.tokenizer import BYTE_OFFSET, EOS_ID, ByteTokenizer

VOCAB = 300  # past the byte tokenizer's 259 ids: the logits may be wider than the vocabulary
BOUNDED = GrammarSpec("json_schema", json.dumps({"type": "string", "maxLength": 8}))


def byte_compiler() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer(VOCAB), VOCAB, [EOS_ID])


def byte_ids(text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in text.encode()]


def accepts(compiler_: GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    matcher = compiler_.compile(spec).matcher()
    return all(matcher.accept_token(t) for t in byte_ids(text)) and matcher.is_completed()


def allowed(matcher, vocab: int = VOCAB) -> set[int]:
    mask = TokenMask(vocab, 1)
    logits = torch.zeros(1, vocab)
    mask.apply(logits, mask.fill([(0, matcher)]))
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


@pytest.mark.parametrize("text", ['"tab\there"', '"bell\x07"', '"nul\x00"'])
def test_raw_control_characters_never_enter_a_json_string(text):
    """xgrammar 0.2.9 lets them into strings of bounded length; compiler.py closes that gap."""
    c = byte_compiler()
    assert not accepts(c, BOUNDED, text)
    assert accepts(c, BOUNDED, '"plain é"')
    assert not accepts(c, GrammarSpec("json_schema", '{"type": "string"}'), text)


def test_special_ids_are_never_text_and_eos_only_where_the_grammar_can_end():
    c = byte_compiler()
    matcher = c.compile(GrammarSpec("regex", "ab?")).matcher()
    assert allowed(matcher) == set(byte_ids("a"))  # not pad, bos or eos
    assert matcher.accept_token(byte_ids("a")[0])
    assert allowed(matcher) == {EOS_ID, *byte_ids("b")}
    assert matcher.accept_token(EOS_ID) and matcher.is_terminated()


def test_choices_are_literal_text():
    c = byte_compiler()
    spec = GrammarSpec("choice", json.dumps(["a.b", "(x|y)*", 'q"\\', "ü"]))
    for text in ["a.b", "(x|y)*", 'q"\\', "ü"]:
        assert accepts(c, spec, text)
    for text in ["axb", "x", "", "(x|y)"]:
        assert not accepts(c, spec, text)


def test_compiled_grammars_are_cached_by_spec_and_shared_across_threads():
    c = byte_compiler()
    spec = GrammarSpec("regex", "[a-z]{1,4}")
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(c.compile(spec))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(r.spec == spec for r in results)
    assert c.compile(spec) is c.compile(GrammarSpec("regex", "[a-z]{1,4}"))


def test_oversized_sources_are_refused_before_compiling():
    with pytest.raises(GrammarError, match="limit"):
        byte_compiler().compile(GrammarSpec("regex", "a" * (compiler.MAX_SOURCE_CHARS + 1)))


class _Stuck:
    """Stands in for xgrammar's compiler: each compile waits until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def compile_regex(self, source: str):
        self.release.wait()
        raise RuntimeError("released")


def test_a_compile_past_its_time_is_rejected_and_stragglers_are_bounded(monkeypatch):
    c = byte_compiler()
    stuck = _Stuck()
    monkeypatch.setattr(c, "_xgr", stuck)
    monkeypatch.setattr(compiler, "COMPILE_TIMEOUT_S", 0.05)
    for i in range(compiler.MAX_ABANDONED):
        with pytest.raises(GrammarError, match="longer than"):
            c.compile(GrammarSpec("regex", f"a{i}"))
    with pytest.raises(GrammarError, match="busy"):
        c.compile(GrammarSpec("regex", "b"))
    stuck.release.set()
    for thread in list(c._abandoned):
        thread.join()
    with pytest.raises(GrammarError, match="invalid regex: released"):  # compiles run again
        c.compile(GrammarSpec("regex", "c"))


def test_mask_applies_to_its_rows_only():
    c = byte_compiler()
    matcher = c.compile(GrammarSpec("choice", '["yes", "no"]')).matcher()
    mask = TokenMask(VOCAB, 2)  # fewer rows than the step: it grows
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    rows = mask.fill([(2, matcher)])
    mask.apply(logits, rows)
    assert rows == [2]
    assert torch.equal(logits[[0, 1, 3]], before[[0, 1, 3]])
    finite = torch.isfinite(logits[2])
    assert set(finite.nonzero().flatten().tolist()) == set(byte_ids("yn"))
    assert torch.equal(logits[2][finite], before[2][finite])


@pytest.mark.slow
def test_hf_special_tokens_never_appear_inside_a_json_string(smollm2):
    """SmolLM2's <|im_start|> and the like are special: never text, wherever the grammar is."""
    tok = smollm2.tokenizer
    vocab = smollm2.config.vocab_size
    c = GrammarCompiler(tok, vocab, eos_token_ids(smollm2.model.generation_config, tok))
    matcher = c.compile(
        GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "string"}}}')
    ).matcher()
    for t in tok.encode('{"a": "x'):
        assert matcher.accept_token(t)
    special = {i for i, t in tok.hf.added_tokens_decoder.items() if t.special}
    inside = allowed(matcher, vocab)
    assert len(inside) > 1000 and not inside & special


@pytest.mark.parametrize(
    ("fmt", "text", "ok"),
    [
        ("time", '"20:00:00.123456789Z"', True),
        ("time", '"20:00:00.1234567890Z"', False),
        ("time", '"20:00:00+01:30"', True),
        ("date-time", '"2025-04-03T14:30:00.5Z"', True),
        ("date-time", '"2025-04-03T14:30:00.0000000000Z"', False),
        ("duration", '"P1234567890123D"', True),  # its digits are not a fraction: unbounded as before
    ],
)
def test_fractions_of_a_second_have_at_most_nine_digits(fmt, text, ok):
    """xgrammar's time fraction is unbounded, where a small greedy model writes zeros until max_tokens."""
    spec = GrammarSpec("json_schema", json.dumps({"type": "string", "format": fmt}))
    assert accepts(byte_compiler(), spec, text) is ok
