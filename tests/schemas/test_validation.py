"""Validation of raw job messages: every failure has a clear reason."""

from __future__ import annotations

import json

import pytest

from schemas.jobs import JobRequest
from schemas.validation import InvalidMessage, Limits, parse_control, parse_job, peek_job_id, peek_tenant

LIMITS = Limits(max_prompt_bytes=100, max_tokens=50, max_stop=2, max_stop_bytes=5, max_message_bytes=2000)


def encode(obj) -> bytes:
    return json.dumps(obj).encode()


def test_valid_prompt_and_messages():
    job = parse_job(encode({"job_id": "a-1", "prompt": "hi", "max_tokens": 5, "stop": ["\n"]}), LIMITS)
    assert job == JobRequest(job_id="a-1", prompt="hi", max_tokens=5, stop=["\n"])
    chat = parse_job(encode({"messages": [{"role": "user", "content": "hi"}]}), LIMITS)
    assert chat.messages[0].content == "hi" and chat.job_id is None


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, "tombstone"),
        (b"x" * 3000, "limit is 2000"),
        (b"\xff\xfe", "not valid UTF-8"),
        (b"{not json", "not JSON"),
        (b"[1]", "JSON object"),
        (encode({"prompt": "x", "colour": "red"}), "colour"),
        (encode({"prompt": "x", "max_tokens": "lots"}), "max_tokens"),
        (encode({"prompt": "x", "max_tokens": 0}), "max_tokens"),
        (encode({"prompt": "x", "temperature": -1}), "temperature"),
        (encode({}), "exactly one of 'prompt' and 'messages'"),
        (encode({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}), "exactly one"),
        (encode({"prompt": "x", "messages": [{"role": "robot", "content": "y"}]}), "role"),
        (encode({"prompt": "x" * 101}), "prompt is 101 bytes"),
        (encode({"prompt": "x", "max_tokens": 51}), "over the limit 50"),
        (encode({"prompt": "x", "stop": ["a", "b", "c"]}), "3 stop strings"),
        (encode({"prompt": "x", "stop": ["abcdef"]}), "longer than 5 bytes"),
        (encode({"prompt": "x", "stop": [""]}), "must not be empty"),
        (encode({"prompt": "x", "job_id": "y" * 129}), "job_id"),
        (encode({"prompt": "x", "job_id": "has space"}), "job_id"),
    ],
)
def test_invalid_messages_have_clear_reasons(value, reason):
    with pytest.raises(InvalidMessage, match=None) as err:
        parse_job(value, LIMITS)
    assert reason in str(err.value)


def test_control_messages():
    assert parse_control(encode({"type": "cancel", "job_id": "a"}), LIMITS).job_id == "a"
    with pytest.raises(InvalidMessage):
        parse_control(encode({"type": "pause", "job_id": "a"}), LIMITS)


def test_peek_job_id_of_broken_messages():
    assert peek_job_id(encode({"job_id": "a", "colour": 1})) == "a"
    assert peek_job_id(b"garbage") is None
    assert peek_job_id(encode({"job_id": "x" * 200})) is None
    assert peek_job_id(encode([1])) is None


LONE = "\ud800"  # json.dumps writes it as the escape `\ud800`, which json.loads turns back into it


@pytest.mark.parametrize(
    ("job", "where"),
    [
        ({"prompt": f"secret {LONE} prompt"}, "prompt contains a lone surrogate (U+D800)"),
        ({"prompt": "x" + "\udfff"}, "prompt contains a lone surrogate (U+DFFF)"),
        ({"messages": [{"role": "user", "content": LONE}]}, "messages.0.content contains a lone surrogate"),
        ({"prompt": "x", "metadata": {"k": LONE}}, "metadata.k contains a lone surrogate"),
        ({"prompt": "x", "metadata": {"k": [{"deep": LONE}]}}, "metadata.k.0.deep contains a lone"),
        ({"prompt": "x", "metadata": {f"k{LONE}": 1}}, "a key in metadata contains a lone surrogate"),
        ({"prompt": "x", "stop": [LONE]}, "stop.0 contains a lone surrogate"),
        ({"prompt": "x", "tenant": f"t{LONE}"}, "tenant contains a lone surrogate"),
        ({"prompt": "x", "job_id": f"j{LONE}"}, "job_id contains a lone surrogate"),
        ({"prompt": "x", "bulk_id": LONE}, "bulk_id contains a lone surrogate"),
    ],
)
def test_lone_surrogates_anywhere_are_rejected_before_any_statement(job, where):
    """PostgreSQL (or psycopg2) refuses a lone surrogate, and the statement that fails on one would fail
    for every job admitted with it: such a job is rejected here, like NUL, with a reason saying where."""
    with pytest.raises(InvalidMessage) as err:
        parse_job(encode(job), LIMITS)
    assert where in str(err.value)
    assert LONE not in str(err.value) and "\udfff" not in str(err.value)  # the reason itself is storable


def test_a_surrogate_pair_is_one_character_and_accepted():
    job = parse_job(
        b'{"prompt": "smile \\ud83d\\ude00", "metadata": {"\\ud83d\\ude00": "\\ud83d\\ude00"}}', LIMITS
    )
    assert job.prompt == "smile \U0001f600" and job.metadata == {"\U0001f600": "\U0001f600"}


def test_lone_surrogates_in_controls_and_peeked_ids_are_refused():
    with pytest.raises(InvalidMessage, match="lone surrogate"):
        parse_control(encode({"type": "cancel", "job_id": "a", "tenant": LONE}), LIMITS)
    # a rejected message's tenant and id are stored with its rejection: never one that cannot be
    assert peek_tenant(encode({"prompt": "x", "tenant": LONE})) == "default"
    assert peek_job_id(encode({"prompt": "x", "job_id": f"a{LONE}"})) is None


def test_depth_and_storability_are_checked_at_the_limits_whatever_the_shortcut():
    """Messages with no \\u escape and few brackets skip the walk over every value; these sit on both sides of
    that shortcut and must be judged alike."""
    limits = Limits(max_depth=4)

    def nested(levels: int) -> bytes:  # the message itself is level 1
        value: object = "x"
        for _ in range(levels - 1):
            value = {"k": value}
        return json.dumps({"prompt": "x", "metadata": value} if levels > 1 else {"prompt": "x"}).encode()

    parse_job(nested(3), limits)  # message, metadata, one dict: 3 levels
    with pytest.raises(InvalidMessage, match="nested deeper than 4 levels"):
        parse_job(nested(5), limits)
    brackets = json.dumps({"prompt": "[[[[{{{{ x"}).encode()  # brackets in text, not nesting
    assert parse_job(brackets, limits).prompt == "[[[[{{{{ x"
    with pytest.raises(InvalidMessage, match="NUL character"):
        parse_job(b'{"prompt": "a\\u0000b"}', limits)
    escaped = json.dumps({"prompt": "caf\u00e9 \U0001f600"}).encode()  # ensure_ascii: \\u escapes, a pair
    assert parse_job(escaped, limits).prompt == "caf\u00e9 \U0001f600"
