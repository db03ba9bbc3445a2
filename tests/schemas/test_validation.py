"""Validation of raw job messages: every failure has a clear reason."""

from __future__ import annotations

import json

import pytest

from schemas.jobs import JobRequest
from schemas.validation import InvalidMessage, Limits, parse_control, parse_job, peek_job_id

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
