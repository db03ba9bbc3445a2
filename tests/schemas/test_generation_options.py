"""The issue-20 fields of a job message: structured outputs, logprobs, n, penalties and logit_bias.
Each value a producer can get wrong is refused with a reason naming the field."""

from __future__ import annotations

import json

import pytest

from schemas.jobs import JobRequest, JsonSchemaFormat
from schemas.validation import InvalidMessage, Limits, logprob_room, parse_job

LIMITS = Limits(max_n=4, max_schema_bytes=200, max_regex_bytes=20, max_choices=3, max_choice_bytes=5,
                max_logprob_entries=1000, max_tokens=500)  # fmt: skip
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]}


def job(**fields) -> JobRequest:
    return parse_job(json.dumps({"prompt": "x", **fields}).encode(), LIMITS)


def test_defaults_ask_for_nothing_new():
    plain = job()
    assert (plain.n, plain.logprobs, plain.top_logprobs, plain.logprobs_k) == (1, False, None, None)
    assert (plain.presence_penalty, plain.frequency_penalty, plain.repetition_penalty) == (0.0, 0.0, None)
    assert plain.response_format is None and plain.guided_regex is None and plain.guided_choice is None
    assert plain.logit_bias is None


def test_openai_json_schema_shape_is_kept_on_the_wire():
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    parsed = job(response_format=fmt)
    assert isinstance(parsed.response_format, JsonSchemaFormat)
    assert parsed.response_format.json_schema.json_schema == SCHEMA
    # what the worker stores in params and what the client sends: OpenAI's spelling, `schema`
    dumped = parsed.model_dump(mode="json")["response_format"]["json_schema"]
    assert dumped["schema"] == SCHEMA and "json_schema" not in dumped
    assert JobRequest.model_validate_json(parsed.model_dump_json()) == parsed
    # as JobClient sends it
    sent = json.dumps(parsed.model_dump(mode="json", exclude_none=True)).encode()
    assert parse_job(sent, LIMITS) == parsed


def test_every_option_at_a_valid_value():
    parsed = job(
        n=4,
        logprobs=True,
        top_logprobs=20,
        max_tokens=10,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1.3,
        logit_bias={"0": -100, "42": 100, "7": 0.5},
        guided_choice=["yes", "no"],
        response_format={"type": "text"},  # text is no constraint: it goes with a guided one
    )
    assert parsed.logprobs_k == 20 and parsed.n == 4
    assert parsed.logit_bias == {"0": -100.0, "42": 100.0, "7": 0.5}
    assert job(logprobs=True).logprobs_k == 0  # the sampled token's logprob, no alternatives
    assert job(response_format={"type": "json_object"}).response_format.type == "json_object"
    assert job(guided_regex="[0-9]{3}").guided_regex == "[0-9]{3}"


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"n": 0}, "n: Input should be greater than or equal to 1"),
        ({"n": 5}, "n 5 is over the limit 4"),
        ({"n": 1.5}, "n: Input should be a valid integer"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs: Input should be less than or equal to 20"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": "maybe"}, "logprobs: Input should be a valid boolean"),
        ({"presence_penalty": 2.01}, "presence_penalty: Input should be less than or equal to 2"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty: Input should be greater than 0"),
        ({"repetition_penalty": 11}, "repetition_penalty: Input should be less than or equal to 10"),
        ({"logit_bias": {"-1": 1}}, "keys must be token ids"),
        ({"logit_bias": {"a": 1}}, "keys must be token ids"),
        ({"logit_bias": {"1" * 10: 1}}, "keys must be token ids"),
        ({"logit_bias": {"5": 100.5}}, "bias of token 5 is 100.5; it must be within -100..100"),
        ({"logit_bias": {"7": 1, "007": 2}}, "token 7 is named twice"),
        ({"logit_bias": {"5": "up"}}, "logit_bias.5"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias: Dictionary should have at most 300"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}, "name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"extra": 1}}}, "extra"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"d": "x" * 300}}}},
         "response_format.json_schema.schema is 308 bytes; the limit is 200"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_regex": "a" * 21}, "guided_regex is over 20 bytes"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice entries must not be empty"),
        ({"guided_choice": ["a", "b", "c", "d"]}, "4 guided_choice entries; at most 3"),
        ({"guided_choice": ["abcdef"]}, "a guided_choice entry is longer than 5 bytes"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one output constraint"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "at most one output constraint"),
        ({"logprobs": True, "top_logprobs": 10, "n": 4, "max_tokens": 25}, "1100 log probabilities"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_with_a_reason(fields, reason):
    with pytest.raises(InvalidMessage) as err:
        job(**fields)
    assert reason in str(err.value)


def test_schema_nesting_is_bounded_like_every_part_of_a_message():
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    fmt = {"type": "json_schema", "json_schema": {"schema": deep}}
    with pytest.raises(InvalidMessage, match="nested deeper than 32 levels"):
        parse_job(json.dumps({"prompt": "x", "response_format": fmt}).encode(), Limits())


def test_logprob_budget_counts_the_deployments_cap_for_a_job_naming_no_max_tokens():
    limits = Limits(max_logprob_entries=128, max_tokens=128)
    assert parse_job(json.dumps({"prompt": "x", "logprobs": True}).encode(), limits).logprobs
    with pytest.raises(InvalidMessage, match="256 log probabilities"):
        parse_job(json.dumps({"prompt": "x", "logprobs": True, "n": 2}).encode(), limits)
    # without a cap the context decides: such a job is accepted, and generates within the bound
    uncapped = parse_job(json.dumps({"prompt": "x", "logprobs": True, "n": 2}).encode(), Limits())
    assert logprob_room(uncapped, Limits(max_logprob_entries=128)) == 64


def test_the_exported_json_schema_names_the_new_fields():
    schema = JobRequest.model_json_schema()
    for name in ("response_format", "guided_regex", "guided_choice", "n", "logprobs", "top_logprobs",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"):  # fmt: skip
        assert name in schema["properties"], name
    assert "schema" in schema["$defs"]["JsonSchemaSpec"]["properties"]


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": "1"},
        {"frequency_penalty": True},
        {"repetition_penalty": "1.1"},
        {"temperature": "0.5"},
        {"logit_bias": {"100": True}},
        {"logit_bias": {"100": "5"}},
        {"n": "2"},
        {"n": True},
        {"logprobs": 1},
        {"logprobs": "true"},
        {"logprobs": True, "top_logprobs": "2"},
        {"max_tokens": "5"},
        {"seed": False},
    ],
)
def test_wrong_types_are_refused_not_converted(fields):
    with pytest.raises(InvalidMessage, match=next(iter(fields))):
        job(**fields)


def test_json_numbers_keep_working_as_json_has_them():
    parsed = job(n=2.0, max_tokens=5.0, presence_penalty=1, temperature=0, logit_bias={"1": 5}, top_k=3)
    assert (parsed.n, parsed.max_tokens, parsed.presence_penalty) == (2, 5, 1.0)
    assert parsed.logit_bias == {"1": 5.0}


@pytest.mark.parametrize(
    ("fields", "valid"),
    [
        ({"n": 16}, True),
        ({"n": 17}, False),
        ({"logit_bias": {"50": -100}}, True),
        ({"logit_bias": {"50": 100.5}}, False),
        ({"logit_bias": {"x": 1}}, False),
        ({"guided_choice": ["a"] * 256}, True),
        ({"guided_choice": ["a"] * 257}, False),
        ({"guided_choice": [""]}, False),
        ({"guided_choice": ["a" * 1001]}, False),
        ({"guided_regex": "a" * 4000}, True),
        ({"guided_regex": "a" * 4001}, False),
        ({"logprobs": True, "top_logprobs": 21}, False),
        ({"presence_penalty": "1"}, False),
    ],
)
def test_the_published_schema_has_the_workers_default_limits(fields, valid):
    """`inferq schema JobRequest` is what producers validate against: it refuses what the worker refuses
    with its default limits (lengths in characters where the worker counts bytes)."""
    import jsonschema

    schema = JobRequest.model_json_schema()
    assert jsonschema.Draft202012Validator(schema).is_valid({"prompt": "x", **fields}) is valid
    if not valid:
        with pytest.raises(InvalidMessage):
            parse_job(json.dumps({"prompt": "x", **fields}).encode(), Limits())
