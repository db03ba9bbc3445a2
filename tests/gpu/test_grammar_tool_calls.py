"""The grammar of forced tool calls: whatever tokens a model picks among those it allows, the output is
calls in the dialect's syntax, of the allowed functions, with arguments valid against their schemas: one
call, or several with `parallel`."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import xgrammar as xgr

from gpu.engine_types import GrammarSpec
from gpu.grammar import GrammarError
from gpu.grammar.compiler import GrammarCompiler, precheck
from gpu.tokenizer import EOS_ID, ByteTokenizer
from schemas.tool_calls import HERMES, LLAMA3_JSON, parse_tool_calls

TOK = ByteTokenizer(512)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
NO_ARGUMENTS = {"type": "object", "properties": {}}
SCHEMAS = {"get_weather": WEATHER, "ping": NO_ARGUMENTS}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOK, 512, [EOS_ID])


def spec(dialect=HERMES, names=("get_weather", "ping"), parallel=False) -> GrammarSpec:
    tools = [{"name": n, "parameters": SCHEMAS[n]} for n in names]
    return GrammarSpec(
        "tool_calls", json.dumps({"dialect": dialect.name, "tools": tools, "parallel": parallel})
    )


def walk(compiled, seed: int, end_bias: float = 0.3, steps: int = 2000) -> str:
    """A model that picks any allowed token (the end, when allowed, with `end_bias`): the text it writes."""
    rng = random.Random(seed)
    matcher, mask, out = compiled.matcher(), xgr.allocate_token_bitmask(1, 512), []
    for _ in range(steps):
        matcher.fill_next_token_bitmask(mask)
        allowed = [t for t in range(512) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
        # single bytes past ASCII would make up characters byte by byte, surrogates among them (which
        # xgrammar's UTF-8 allows and Python's refuses): ASCII and the printable ids past the bytes only
        allowed = [t for t in allowed if not 3 + 0x80 <= t < 259] or allowed
        token = EOS_ID if EOS_ID in allowed and (len(allowed) == 1 or rng.random() < end_bias) else None
        token = token if token is not None else rng.choice([t for t in allowed if t != EOS_ID])
        assert matcher.accept_token(token)
        if token == EOS_ID:
            assert matcher.is_terminated()
            return TOK.decode(out)
        out.append(token)
    raise AssertionError(f"no end after {steps} tokens: {TOK.decode(out)!r}")


def calls_in(text: str, dialect) -> list[tuple[str, dict]]:
    content, calls = parse_tool_calls(text, dialect)
    assert content == "", text
    found = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    for name, arguments in found:
        jsonschema.validate(arguments, SCHEMAS[name])
    return found


@pytest.mark.parametrize("seed", range(12))
def test_one_call_of_an_allowed_function_with_valid_arguments(compiler, seed):
    text = walk(compiler.compile(spec()), seed)
    assert len(calls_in(text, HERMES)) == 1
    assert text.startswith('<tool_call>\n{"name": "') and text.endswith("}\n</tool_call>")


def test_a_named_function_is_the_only_one_called(compiler):
    named = compiler.compile(spec(names=("get_weather",)))
    assert {calls_in(walk(named, s), HERMES)[0][0] for s in range(6)} == {"get_weather"}


def test_parallel_allows_several_calls_separated_as_the_dialect_does(compiler):
    several = compiler.compile(spec(parallel=True))
    counts = [len(calls_in(walk(several, s, end_bias=0.2), HERMES)) for s in range(12)]
    assert min(counts) >= 1 and max(counts) > 1


def test_llama3_json_writes_one_bare_object_with_parameters(compiler):
    text = walk(compiler.compile(spec(LLAMA3_JSON, parallel=True)), 3)  # one call a turn, whatever parallel
    assert text.startswith('{"name": "') and '"parameters": ' in text
    assert len(calls_in(text, LLAMA3_JSON)) == 1


def test_schemas_the_grammar_cannot_enforce_are_refused_naming_the_function(compiler):
    bad = GrammarSpec("tool_calls", json.dumps({"dialect": "hermes", "parallel": False, "tools": [
        {"name": "f", "parameters": {"type": "object", "properties": {"a": {"not": {}}}}}]}))  # fmt: skip
    for check in (compiler.compile, precheck):
        with pytest.raises(GrammarError, match="function f's parameters: .*'not'"):
            check(bad)
    with pytest.raises(GrammarError, match="tool_calls must be JSON"):
        precheck(GrammarSpec("tool_calls", '{"dialect": "klingon", "tools": []}'))
