"""The tool-call parser: calls out of a model's text, in each dialect, the same however the text is cut into
deltas, and the deltas adding up to the final calls."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.tool_calls import HERMES, LLAMA3_JSON, ToolCallParser, call_id, parse_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
TWO = (
    "Let me look both up.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_time"}\n</tool_call>'
)
TEXTS = [
    CALL,
    TWO,
    "No call here, only a < sign and <tool talk.",
    "<tool_call>\nthis is not JSON\n</tool_call> and text after it",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off by max_tokens
    '<tool_call>\n{"name": "f", "arguments": {"s": "a } ] </tool_call> inside a string"}}\n</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>Then more text.',
]


def calls_of(text: str, dialect=HERMES) -> tuple[str, list[tuple[str, dict | str]]]:
    content, calls = parse_tool_calls(text, dialect, seed="job")
    out = []
    for c in calls:
        try:
            out.append((c["function"]["name"], json.loads(c["function"]["arguments"])))
        except ValueError:
            out.append((c["function"]["name"], c["function"]["arguments"]))
    return content, out


def test_a_hermes_call_is_parsed_and_nothing_is_left_as_content():
    assert calls_of(CALL) == ("", [("get_weather", {"city": "Paris", "days": [1, 2]})])


def test_content_before_calls_and_calls_in_any_key_order():
    assert calls_of(TWO) == (
        "Let me look both up.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Rome"})],
    )


def test_text_without_calls_is_all_content():
    text = "No call here, only a < sign and <tool talk."
    assert calls_of(text) == (text, [])


def test_a_block_that_is_no_call_is_content_as_written():
    text = "<tool_call>\nthis is not JSON\n</tool_call> and text after it"
    assert calls_of(text) == (text, [])


def test_a_call_cut_short_keeps_the_arguments_written():
    content, calls = parse_tool_calls(TEXTS[4], HERMES)
    assert content == "" and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}


def test_a_close_marker_inside_a_string_does_not_end_the_call():
    assert calls_of(TEXTS[5]) == ("", [("f", {"s": "a } ] </tool_call> inside a string"})])


def test_llama3_json_is_a_bare_object_with_parameters():
    assert calls_of('{"name": "f", "parameters": {"a": 1}}', LLAMA3_JSON) == ("", [("f", {"a": 1})])
    assert calls_of('  {"parameters": {"a": 1}, "name": "f"}', LLAMA3_JSON) == ("", [("f", {"a": 1})])
    assert calls_of('Sure: {"a": 1}', LLAMA3_JSON) == ('Sure: {"a": 1}', [])
    assert calls_of('{"a": 1} is JSON', LLAMA3_JSON) == ('{"a": 1} is JSON', [])


def test_ids_are_openais_shape_and_the_same_for_the_same_job_sample_and_position():
    assert re.fullmatch(r"call_[0-9a-f]{24}", call_id("t/job", 0, 0))
    assert call_id("t/job", 0, 0) == call_id("t/job", 0, 0)
    ids = {call_id("t/job", 0, 0), call_id("t/job", 0, 1), call_id("t/job", 1, 0), call_id("u", 0, 0)}
    assert len(ids) == 4
    _, calls = parse_tool_calls(TWO, HERMES, seed="t/job", index=1)
    assert [c["id"] for c in calls] == [call_id("t/job", 1, 0), call_id("t/job", 1, 1)]


def test_the_first_delta_names_the_call_and_later_ones_append_arguments():
    parser = ToolCallParser(HERMES, lambda k: f"call_{k}")
    first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert list(first.tool_calls) == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    ]
    more = parser.feed('{"city": "Pa')
    assert list(more.tool_calls) == [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]
    rest = parser.feed('ris"}}\n</tool_call>')
    assert list(rest.tool_calls) == [{"index": 0, "function": {"arguments": 'ris"}'}}]
    assert parser.finish().tool_calls == ()


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 200), max_size=12))
def test_any_cut_into_deltas_gives_the_same_content_and_calls(text, cuts):
    whole_content, whole_calls = parse_tool_calls(text, HERMES, seed="s")
    parser = ToolCallParser(HERMES, lambda k: call_id("s", 0, k))
    outs = [parser.feed(piece) for piece in _split(text, cuts)] + [parser.finish()]
    assert "".join(o.content for o in outs) == whole_content
    assert parser.calls == whole_calls
    rebuilt: dict[int, dict] = {}  # the deltas, put together as an SDK user would
    for out in outs:
        for delta in out.tool_calls:
            call = rebuilt.setdefault(delta["index"], {"id": delta.get("id"), "name": None, "arguments": ""})
            call["name"] = call["name"] or delta["function"].get("name")
            call["arguments"] += delta["function"]["arguments"]
    assert [rebuilt[i] for i in sorted(rebuilt)] == [{"id": c["id"], **c["function"]} for c in whole_calls]
