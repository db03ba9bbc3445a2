"""Intake rules: records become engine-ready jobs or rejections, with stable ids."""

from __future__ import annotations

import json

from gpu.tokenizer import ByteTokenizer
from schemas.topics import Topics
from schemas.validation import Limits
from workers.kafka_io import Record
from workers.serving.intake.rejected import Rejected
from workers.serving.intake.validation import Accepted, Intake

TOPICS = Topics("inferq")


def make_intake(max_model_len: int = 64, **limits) -> Intake:
    return Intake(TOPICS, Limits(**limits), ByteTokenizer(32000), max_model_len)


def make_record(value, topic: str = "inferq.jobs.low", offset: int = 7) -> Record:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return Record(topic, 2, offset, b"k", raw, 1_700_000_000_000)


def test_accepts_with_priority_from_topic_and_clamps_to_context():
    decision = make_intake().accept(make_record({"job_id": "j1", "prompt": "hello", "max_tokens": 500}))
    assert isinstance(decision, Accepted)
    assert decision.priority == "low" and decision.job_id == "j1"
    assert decision.prompt_token_ids == tuple(ByteTokenizer().encode("hello"))
    assert decision.max_tokens == 64 - 6  # the context has room for 58 more tokens


def test_default_max_tokens_respects_the_cap():
    decision = make_intake(max_model_len=4096, max_tokens=50).accept(make_record({"prompt": "x"}))
    assert isinstance(decision, Accepted) and decision.max_tokens == 50
    over = make_intake(max_model_len=4096, max_tokens=50).accept(
        make_record({"prompt": "x", "max_tokens": 51})
    )
    assert isinstance(over, Rejected) and "over the limit 50" in over.error


def test_no_max_tokens_means_the_context_left_and_any_value_up_to_it_is_taken():
    """No cap by default: a job naming no max_tokens may generate until prompt + output fill the context
    (it used to stop at 128), and a max_tokens past 4096 (once refused) is taken, clamped to the room."""
    intake = make_intake(max_model_len=8192)
    default = intake.accept(make_record({"prompt": "hello"}))
    assert isinstance(default, Accepted) and default.max_tokens == 8192 - 6
    large = intake.accept(make_record({"prompt": "hello", "max_tokens": 6000}))
    assert isinstance(large, Accepted) and large.max_tokens == 6000
    past = intake.accept(make_record({"prompt": "hello", "max_tokens": 100_000}))
    assert isinstance(past, Accepted) and past.max_tokens == 8192 - 6
    # log probabilities are stored with the row: a job naming no max_tokens stays within their bound
    logprobs = intake.accept(make_record({"prompt": "hello", "logprobs": True, "top_logprobs": 4}))
    assert isinstance(logprobs, Accepted) and logprobs.max_tokens == 8192 - 6
    small = make_intake(max_model_len=8192, max_logprob_entries=1000)
    bounded = small.accept(make_record({"prompt": "hello", "logprobs": True, "top_logprobs": 4}))
    assert isinstance(bounded, Accepted) and bounded.max_tokens == 200


def test_missing_job_id_is_derived_from_the_record():
    decision = make_intake().accept(make_record({"prompt": "x"}, topic="inferq.jobs.high", offset=42))
    assert decision.job_id == "inferq.jobs.high:2:42" and decision.priority == "high"


def test_messages_use_the_chat_template():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    decision = make_intake(max_model_len=512).accept(make_record({"messages": msgs}))
    assert isinstance(decision, Accepted)
    assert decision.prompt_token_ids == tuple(ByteTokenizer().apply_chat_template(msgs))
    assert decision.prompt_text == "system: be brief\nuser: hi"


def test_rejections_keep_a_readable_job_id_and_reason():
    bad = make_intake().accept(make_record({"job_id": "j2", "prompt": "x", "extra": 1}))
    assert isinstance(bad, Rejected) and bad.job_id == "j2" and "extra" in bad.error
    broken = make_intake().accept(make_record(b"\x00not json", offset=9))
    assert isinstance(broken, Rejected) and broken.job_id == "inferq.jobs.low:2:9"
    too_long = make_intake(max_model_len=8).accept(make_record({"job_id": "j3", "prompt": "x" * 20}))
    assert isinstance(too_long, Rejected) and "context is 8 tokens" in too_long.error
    empty = make_intake().accept(make_record({"job_id": "j4", "prompt": ""}))
    assert isinstance(empty, Rejected) and "empty" in empty.error


def test_a_lone_surrogate_is_rejected_with_a_storable_rejection():
    """JSON's `\\ud800` escape decodes to a lone surrogate that neither psycopg2 nor PostgreSQL takes: the
    job is rejected at intake, and what its rejection stores (id, tenant, reason) is valid UTF-8."""
    for job in (
        {"job_id": "j5", "tenant": "acme", "prompt": "x", "metadata": {"note": "\ud800"}},
        {"job_id": "j6", "tenant": "t\udc00", "prompt": "x"},
    ):
        bad = make_intake().accept(make_record(job, offset=11))
        assert isinstance(bad, Rejected), job
        assert "lone surrogate" in bad.error and bad.reason == "invalid"
        assert bad.job_id == job["job_id"] and bad.tenant in ("acme", "default")
        for text in (bad.job_id, bad.tenant, bad.error):
            text.encode("utf-8")  # raises on a surrogate
