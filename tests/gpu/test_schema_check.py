"""JSON Schema keywords xgrammar would drop are refused at compile time; the ones let through are enforced.

Each refused case is a schema xgrammar 0.2.9 compiles without complaint into a grammar that accepts a value
the schema forbids (the `forbidden` column proves it against the installed xgrammar, so an upgrade that
starts enforcing a keyword shows up here as a failure to update the list)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from gpu.engine_types import GrammarSpec
from gpu.grammar import GrammarError
from gpu.grammar.compiler import _json_ebnf
from gpu.grammar.schema_check import check_enforceable
from tests.gpu.test_grammar_compiler import byte_compiler

INT_ARRAY = {"type": "array", "items": {"type": "integer"}}
PAIR = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
DEFS = {"$defs": {"x": {"type": "integer"}}}

# (schema, keyword named in the reason, JSON path named, a value the schema forbids that xgrammar accepts)
DROPPED = [
    ({**INT_ARRAY, "uniqueItems": True}, "uniqueItems", "$", "[1, 1]"),
    ({**INT_ARRAY, "contains": {"const": 3}}, "contains", "$", "[1]"),
    ({"type": "integer", "not": {"const": 3}}, "not", "$", "3"),
    ({"not": {}}, "not", "$", "1"),
    ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, "if", "$", "7"),
    ({**PAIR, "dependentRequired": {"a": ["b"]}}, "dependentRequired", "$", '{"a": 1}'),
    ({**PAIR, "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas", "$", '{"a": 1}'),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "$", "0.3"),
    ({"type": "integer", "multipleOf": 2.5}, "multipleOf", "$", "4"),
    ({"type": "integer", "minimum": 1, "multipleOf": 7}, "multipleOf", "$", "8"),
    ({"type": "integer", "maximum": 100, "multipleOf": 7}, "multipleOf", "$", "8"),
    ({"type": "integer", "minimum": 0, "maximum": 10_000, "multipleOf": 7}, "multipleOf", "$", "8"),
    ({"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]}, "allOf", "$", "7"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "$", "1"),
    ({"anyOf": [{"type": "integer"}], "maximum": 5}, "maximum", "$", "7"),
    ({**DEFS, "$ref": "#/$defs/x", "minimum": 3}, "minimum", "$", "1"),
    ({"type": "integer", "enum": [1, "a"]}, "type", "$", '"a"'),
    ({"type": "string", "const": "a", "maxLength": 0}, "maxLength", "$", '"a"'),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength", "$", '"aaaa"'),
    ({"type": "string", "format": "email", "maxLength": 5}, "maxLength", "$", '"abcdef@x.com"'),
    ({"type": "string", "format": "idn-hostname"}, "format", "$", None),
    ({"minimum": 3}, "minimum", "$", "1"),
    (
        {"type": "object", "properties": {"tags": {**INT_ARRAY, "uniqueItems": True}}},
        "uniqueItems",
        "$.properties.tags",
        '{"tags": [2, 2]}',
    ),
    (
        {**DEFS, "$defs": {"x": {"type": "integer", "not": {"const": 1}}}, "$ref": "#/$defs/x"},
        "not",
        "$.$defs.x",
        "1",
    ),
    ({"anyOf": [{"type": "integer", "if": {}, "then": {}}]}, "if", "$.anyOf[0]", None),
    (
        {"type": "array", "prefixItems": [{**INT_ARRAY, "uniqueItems": True}]},
        "uniqueItems",
        "$.prefixItems[0]",
        None,
    ),
]


def grammar_accepts(schema: object, text: str) -> bool:
    grammar = xgr.Grammar.from_ebnf(_json_ebnf(json.dumps(schema)))
    return _is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize(("schema", "keyword", "path", "forbidden"), DROPPED)
def test_keywords_xgrammar_drops_are_refused_with_keyword_and_path(schema, keyword, path, forbidden):
    if forbidden is not None:  # the reason for refusing: the grammar lets through what the schema forbids
        assert not jsonschema.Draft202012Validator(schema, format_checker=FORMATS).is_valid(
            json.loads(forbidden)
        )
        assert grammar_accepts(schema, forbidden)
    with pytest.raises(GrammarError, match=re.escape(f"keyword '{keyword}' at {path} ")):
        check_enforceable(schema)
    with pytest.raises(GrammarError, match=keyword):  # and so does the compiler, before compiling
        byte_compiler().compile(GrammarSpec("json_schema", json.dumps(schema)))


# (schema, a value it forbids: the grammar must refuse it too)
ENFORCED = [
    ({**INT_ARRAY, "minItems": 2, "maxItems": 2, "uniqueItems": False}, "[1]"),
    ({"type": "integer", "minimum": 0, "exclusiveMaximum": 5, "multipleOf": 2}, "3"),
    ({"type": "integer", "minimum": 1, "maximum": 10_000, "multipleOf": 7}, "8"),
    ({"type": "integer", "multipleOf": 7}, "-8"),
    (
        {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "minProperties": 3,
            "maxProperties": 3,
        },
        '{"a": 1}',
    ),  # fmt: skip
    ({"type": "number", "minimum": 0, "maximum": 1}, "1.5"),
    ({"type": "string", "minLength": 2, "maxLength": 3, "title": "t", "description": "d"}, '"a"'),
    ({"type": "string", "pattern": "^[0-9]{5}$", "examples": ["12345"]}, '"1234"'),
    ({"type": "string", "format": "date"}, '"2020-13-45"'),
    ({"type": "string", "format": "uuid"}, '"x"'),
    ({**PAIR, "required": ["a"], "additionalProperties": False}, '{"b": 1}'),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, '{"a": "x"}'),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1}, '{"a": 1, "b": 2}'),
    (
        {"type": "object", "propertyNames": {"pattern": "^a"}, "additionalProperties": {"type": "integer"}},
        '{"b": 1}',
    ),
    ({"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "x"}, "1"),
    ({"allOf": [{"type": "integer", "minimum": 3}]}, "1"),
    ({"oneOf": [{"type": "integer"}]}, '"a"'),
    ({"type": "string", "enum": ["a", "b"]}, '"c"'),
    ({"type": "number", "enum": [1, 2.5]}, "3"),
    ({"const": "kg"}, '"g"'),
    ({**DEFS, "type": "object", "properties": {"p": {"$ref": "#/$defs/x"}}, "required": ["p"]}, '{"p": "s"}'),
    ({"type": "array", "prefixItems": [{"type": "string"}], "items": False}, '["a", 1]'),
    ({"type": ["integer", "string"], "minimum": 3, "maxLength": 1}, '"abc"'),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}"),
]


@pytest.mark.parametrize(("schema", "forbidden"), ENFORCED)
def test_keywords_let_through_are_enforced(schema, forbidden):
    check_enforceable(schema)
    assert not jsonschema.Draft202012Validator(schema, format_checker=FORMATS).is_valid(json.loads(forbidden))
    assert not grammar_accepts(schema, forbidden)


def test_depth_is_bounded():
    schema: dict = {"type": "integer"}
    for _ in range(80):
        schema = {"type": "array", "items": schema}
    with pytest.raises(GrammarError, match="deeper than"):
        check_enforceable(schema)
