"""OpenAI Batch input parsing and validation (no services)."""

from __future__ import annotations

import json

import pytest

from schemas.validation import InvalidMessage
from tests.workers.bulk_factories import CHAT, COMPLETIONS, batch_line, write_batch
from workers.bulk.batch_format import (
    BatchLine,
    LineError,
    job_id_for,
    parse_line,
    read_batch,
    summarize,
    to_job,
)


def parse(line: dict | str, line_no: int = 1) -> BatchLine | LineError:
    return parse_line(line if isinstance(line, str) else json.dumps(line), line_no)


def test_completion_line_becomes_a_job():
    item = parse(batch_line("a-1", prompt="Say hi", max_tokens=7, temperature=0.5, stop="\n", seed=3))
    assert isinstance(item, BatchLine)
    job = to_job(item, bulk_id="bulk-x", tenant="acme")
    assert (job.job_id, job.bulk_id, job.tenant) == ("bulk-x:a-1", "bulk-x", "acme")
    assert (job.prompt, job.max_tokens, job.temperature, job.stop, job.seed) == ("Say hi", 7, 0.5, ["\n"], 3)
    assert job.metadata == {"custom_id": "a-1"}
    assert job.stream is False  # a batch's results are what is read: no token events


def test_chat_line_with_text_parts_and_max_completion_tokens():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
    item = parse(batch_line("c", CHAT, messages=messages, max_completion_tokens=9))
    job = to_job(item, bulk_id="b", tenant="t")
    assert [(m.role, m.content) for m in job.messages] == [("system", "be brief"), ("user", "ab")]
    assert job.max_tokens == 9 and job.prompt is None


BOUNDS_CROSSED = {"type": "integer", "minimum": 5, "maximum": 1}


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "a line must be a JSON object"),
        ({**batch_line("x"), "extra": 1}, "unknown fields: extra"),
        ({**batch_line("x"), "method": "GET"}, "method must be"),
        ({**batch_line("x"), "url": "/v1/embeddings"}, "url must be one of"),
        ({**batch_line("x"), "custom_id": ""}, "custom_id must be"),
        (batch_line("x", tools=[]), "unsupported body fields for /v1/completions: tools"),
        (batch_line("x", logprobs=21), "body.logprobs must be an integer 0-20"),
        (batch_line("x", logprobs=True), "body.logprobs must be an integer 0-20"),
        (batch_line("x", top_logprobs=2), "unsupported body fields for /v1/completions: top_logprobs"),
        (batch_line("x", CHAT, top_logprobs=2), "top_logprobs needs logprobs: true"),
        (batch_line("x", CHAT, logprobs=True, top_logprobs=21), "top_logprobs"),
        (batch_line("x", n=17), "n: Input should be less than or equal to 16"),
        (batch_line("x", n=0), "n: Input should be greater than or equal to 1"),
        (batch_line("x", stream=True), "body.stream must be false"),
        (batch_line("x", presence_penalty=2.5), "presence_penalty"),
        (batch_line("x", frequency_penalty=-3), "frequency_penalty"),
        (batch_line("x", repetition_penalty=0), "repetition_penalty"),
        (batch_line("x", logit_bias={"hello": 1}), "keys must be token ids"),
        (batch_line("x", logit_bias={"5": 101}), "within -100..100"),
        (batch_line("x", CHAT, response_format={"type": "xml"}), "response_format"),
        (
            batch_line(
                "x",
                CHAT,
                response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
            ),
            "response_format cannot be compiled: json_schema: type at $ must be one of",
        ),
        (
            batch_line("x", response_format={"type": "json_schema", "json_schema": {"schema": {"not": {}}}}),
            "response_format cannot be compiled: json_schema keyword 'not' at $ cannot be enforced",
        ),
        (batch_line("x", guided_regex="(ab"), "guided_regex cannot be compiled: invalid regex"),
        (
            batch_line(
                "x", response_format={"type": "json_schema", "json_schema": {"schema": BOUNDS_CROSSED}}
            ),
            "response_format cannot be compiled: invalid json_schema: ",  # xgrammar's own reason
        ),
        (batch_line("x", guided_regex="a+", guided_choice=["a"]), "at most one output constraint"),
        (batch_line("x", guided_choice=[]), "guided_choice"),
        (batch_line("x", CHAT, echo=False), "unsupported body fields for /v1/chat/completions: echo"),
        (batch_line("x", prompt=["a", "b"]), "body.prompt must be a string"),
        (batch_line("x", max_tokens=0), "max_tokens"),
        (batch_line("x", max_tokens=2.5), "max_tokens"),
        (batch_line("x", temperature=9), "temperature"),
        (batch_line("x", CHAT, messages=[]), "body.messages must be a non-empty list"),
        (batch_line("x", CHAT, messages=[{"role": "robot", "content": "hi"}]), "role"),
        (batch_line("x", CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "only text"),
    ],
)
def test_invalid_lines_say_why_with_their_line_number(line, expected):
    item = parse(line, line_no=17)
    assert isinstance(item, LineError)
    assert item.message.startswith("line 17: ") and expected in item.message
    assert item.line_no == 17


# the generation options at their defaults are accepted as well: they change nothing
NEUTRAL_BODY = {
    "n": 1,
    "stream": False,
    "stream_options": {"include_usage": True},
    "user": "u-1",
    "logprobs": False,
    "presence_penalty": 0,
    "frequency_penalty": 0.0,
    "logit_bias": {},
    "service_tier": "auto",
}


@pytest.mark.parametrize(
    ("url", "extra"),
    [
        (COMPLETIONS, {"best_of": 1, "echo": False, "suffix": None}),
        (
            CHAT,
            {"top_logprobs": 0, "response_format": {"type": "text"}, "store": False, "metadata": {"a": "b"}},
        ),
    ],
)
def test_fields_at_values_that_change_nothing_are_accepted_and_ignored(url, extra):
    item = parse(batch_line("ok", url, **NEUTRAL_BODY, **extra))
    assert isinstance(item, BatchLine), item
    plain = to_job(parse(batch_line("ok", url)), bulk_id="b", tenant="t")
    assert to_job(item, bulk_id="b", tenant="t") == plain


def test_custom_id_is_kept_on_an_error_when_readable():
    item = parse(batch_line("keep-me", n=99))
    assert isinstance(item, LineError) and item.custom_id == "keep-me"


def test_read_batch_numbers_physical_lines_skips_blank_ones_and_flags_duplicates(tmp_path):
    path = write_batch(
        tmp_path / "in.jsonl", [batch_line("a"), "", batch_line("b"), "{oops", batch_line("a")]
    )
    items = list(read_batch(path))
    assert [(i.line_no, type(i).__name__) for i in items] == [
        (1, "BatchLine"), (3, "BatchLine"), (4, "LineError"), (5, "LineError"),
    ]  # fmt: skip
    assert "duplicate custom_id 'a'" in items[3].message
    summary = summarize(path)
    assert (summary.total, summary.invalid, summary.endpoint) == (4, 2, "/v1/completions")
    assert [e.line_no for e in summary.errors] == [4, 5]


def test_a_line_that_is_not_utf8_is_an_error_not_a_replacement(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(json.dumps(batch_line("a")).encode() + b"\n" + b'{"custom_id": "\xff"}\n')
    items = list(read_batch(path))
    assert isinstance(items[0], BatchLine)
    assert isinstance(items[1], LineError) and items[1].message.startswith("line 2: not valid UTF-8")


def test_summary_endpoint_is_mixed_when_lines_differ(tmp_path):
    path = write_batch(tmp_path / "in.jsonl", [batch_line("a"), batch_line("b", CHAT)])
    assert summarize(path).endpoint == "mixed"


def test_job_ids_are_deterministic_and_always_valid():
    assert job_id_for("bulk-1", "row-7") == "bulk-1:row-7" == job_id_for("bulk-1", "row-7")
    odd = job_id_for("bulk-1", "has space & ünïcode")
    assert odd.startswith("bulk-1:=") and odd == job_id_for("bulk-1", "has space & ünïcode")
    long = job_id_for("bulk-1", "x" * 200)
    assert len(long) <= 128 and long != job_id_for("bulk-1", "x" * 201)
    # a custom_id that looks like a digest cannot collide with one
    assert job_id_for("b", "=abc") != "b:=abc"
    # both pass the worker's job_id validation
    for custom_id in ("has space & ünïcode", "x" * 200):
        item = parse(batch_line(custom_id))
        assert to_job(item, bulk_id="bulk-1", tenant="t").job_id == job_id_for("bulk-1", custom_id)


def test_to_job_rejects_what_the_worker_would_reject():
    item = BatchLine(1, "x", "/v1/completions", None, {"prompt": "p", "stop": ["a"] * 9})
    with pytest.raises(InvalidMessage, match="stop strings"):
        to_job(item, bulk_id="b", tenant="t")
