"""What an SDK user meets first (issue 40, item 1), through the official `openai` SDK against `inferq api` and
a tiny-model worker: no max_tokens generates up to the context left (not 128), a max_tokens past the old
4096 cap is taken, `created` is the request's time, and `usage.prompt_tokens_details.cached_tokens` says
what the prefix cache served, in the answer, the stream's usage chunk and the jobs row alike."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import create_engine, select

from schemas.tables import jobs
from tests.api.api_factories import MODEL

pytestmark = [pytest.mark.services, pytest.mark.slow]

NO_EOS = {"2": -100}  # the tiny model's EOS (ByteTokenizer's id 2) never chosen: it runs to its length


def _context(client) -> int:
    [card] = [m for m in client.models.list() if m.id == MODEL]
    return card.max_model_len  # as the worker announced it


def _row(dep, job_id: str) -> dict:
    db = create_engine(dep.database_url)
    try:
        with db.connect() as conn:
            return dict(conn.execute(select(jobs).where(jobs.c.job_id == job_id)).mappings().one())
    finally:
        db.dispose()


def test_no_max_tokens_generates_up_to_the_context_left(served):
    dep, api, keys = served
    client = api.client(keys["acme"])
    context = _context(client)
    prompt = "a" * (context - 260)  # about 260 tokens of room (the byte tokenizer: a token a byte, and BOS)
    sent = time.time()
    answer = client.completions.create(model=MODEL, prompt=prompt, temperature=0, logit_bias=NO_EOS)
    used = answer.usage
    assert used.completion_tokens > 128  # the old default stopped here
    assert (
        used.prompt_tokens + used.completion_tokens == context and answer.choices[0].finish_reason == "length"
    )
    # `created` is when the request was made, not when its job finished (it ran for seconds)
    row = _row(dep, answer.id)
    assert abs(answer.created - sent) <= 2
    assert answer.created < int(row["finished_at"].timestamp())


def test_a_max_tokens_past_the_old_cap_is_taken_and_bounded_by_the_context(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    context = _context(client)
    answer = client.completions.create(
        model=MODEL, prompt="b" * (context - 40), max_tokens=5000, temperature=0, logit_bias=NO_EOS
    )
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens == context


def test_cached_tokens_are_the_prompt_tokens_the_prefix_cache_served(served):
    dep, api, keys = served
    client = api.client(keys["acme"])
    prompt = f"A shared preamble of some length, {time.time()}: " * 4  # a few full 16-token blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < again.usage.prompt_tokens and cached % 16 == 0  # whole blocks, never the last token
    assert _row(dep, again.id)["cached_tokens"] == cached
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2, temperature=0
    )
    assert chat.usage.prompt_tokens_details.cached_tokens is not None
