"""The API's parts that need no running API: the key cache's negative entries (one database query per bad
key), the bad-key allowance per address, the batch driver's turn order, retries' request keys, and file
content read back as lines from its chunks (on the real PostgreSQL)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
from sqlalchemy import create_engine

from schemas.tables import FILE_CHUNK_BYTES
from workers.api import auth
from workers.api.auth import KeyCache
from workers.api.batch_driver import interleaved
from workers.api.errors import APIError
from workers.api.limits import TenantLimits, TokenBuckets
from workers.api.retries import request_key
from workers.db import api_files, api_keys


class _Ctx:
    """The context `auth.tenant` reads: a key cache, limits, and a database whose look-ups are counted."""

    def __init__(self, keys: dict[str, str], bad_key_rpm: int = 0) -> None:
        self.keys = KeyCache(bad_key_rpm=bad_key_rpm)
        self.limits = TenantLimits()
        self.lookups = 0
        self.known = {api_keys.key_hash(k): t for k, t in keys.items()}
        self.db = SimpleNamespace(connect=contextlib.nullcontext)

    async def run_db(self, call, *args):
        self.lookups += 1
        return call(*args)


@pytest.fixture(autouse=True)
def _keys_from_the_context(monkeypatch):
    """`api_keys.tenant_of` answers from the fake context's keys (no database here)."""
    current: list[_Ctx] = []
    monkeypatch.setattr(
        auth.api_keys, "tenant_of", lambda conn, key: current[-1].known.get(api_keys.key_hash(key))
    )
    return current


def _tenant(ctx: _Ctx, key: str | None, address: str = "10.0.0.1") -> str | int:
    request = SimpleNamespace(
        headers={"authorization": f"Bearer {key}"} if key else {}, client=SimpleNamespace(host=address),
        state=SimpleNamespace(), app=SimpleNamespace(state=SimpleNamespace(api=ctx)),
    )  # fmt: skip
    try:
        return asyncio.run(auth.tenant(request))
    except APIError as exc:
        return exc.status


def test_a_bad_key_costs_one_look_up_then_none_while_remembered(_keys_from_the_context):
    ctx = _Ctx({"iq-good": "acme"})
    _keys_from_the_context.append(ctx)
    assert [_tenant(ctx, "iq-bad") for _ in range(5)] == [401] * 5
    assert ctx.lookups == 1  # the first; the others were answered from the cache
    assert _tenant(ctx, "iq-good") == "acme" and _tenant(ctx, "iq-good") == "acme"
    assert ctx.lookups == 2
    assert _tenant(ctx, None) == 401 and ctx.lookups == 2  # no key: nothing to look up


def test_the_negative_cache_is_bounded_and_forgets_the_oldest_first(monkeypatch):
    monkeypatch.setattr(auth, "_MAX_CACHED", 3)
    cache = KeyCache()
    for name in ("a", "b", "c", "d"):
        cache.put(name, None)
    assert [cache.bad(name) for name in ("a", "b", "c", "d")] == [False, True, True, True]


def test_an_address_out_of_bad_key_allowance_gets_no_look_up(_keys_from_the_context):
    ctx = _Ctx({"iq-good": "acme"}, bad_key_rpm=2)
    _keys_from_the_context.append(ctx)
    assert [_tenant(ctx, f"iq-guess-{i}") for i in range(4)] == [401, 401, 429, 429]
    assert ctx.lookups == 2  # the guesses past the allowance were not looked up
    assert _tenant(ctx, "iq-guess-x", address="10.0.0.2") == 401  # another address has its own allowance


def test_token_buckets_check_without_counting_and_forget_the_least_recent():
    buckets = TokenBuckets(2, max_names=2)
    buckets.take("a", "a's requests")
    buckets.check("a", "a's requests")
    buckets.take("a", "a's requests")
    with pytest.raises(APIError) as caught:
        buckets.check("a", "a's requests")
    assert caught.value.status == 429 and caught.value.headers["x-should-retry"] == "true"
    buckets.take("b", "")
    buckets.take("c", "")  # "a" is forgotten: it starts with a full bucket again
    buckets.take("a", "")


def test_turns_interleave_tenants_oldest_batch_first():
    batches = [("a1", "acme"), ("a2", "acme"), ("a3", "acme"), ("g1", "globex"), ("i1", "initech")]
    rows = [{"batch_id": b, "tenant": t} for b, t in batches]
    assert [r["batch_id"] for r in interleaved(rows)] == ["a1", "g1", "i1", "a2", "a3"]
    assert interleaved([]) == []


def test_a_request_key_is_its_body_its_retry_count_and_its_idempotency_key():
    def key(headers: dict[str, str], body: dict):
        return request_key(SimpleNamespace(headers=headers), "/v1/completions", body, {"stream": False})

    first = key({"x-stainless-retry-count": "0"}, {"prompt": "p", "max_tokens": 3})
    retry = key({"x-stainless-retry-count": "1"}, {"max_tokens": 3, "prompt": "p"})
    assert first.fingerprint == retry.fingerprint and (first.retry, retry.retry) == (False, True)
    assert first.sdk and not key({}, {"prompt": "p"}).sdk
    assert key({}, {"prompt": "q"}).fingerprint != first.fingerprint
    keyed = key({"idempotency-key": "k1"}, {"prompt": "p"})
    assert keyed.explicit == "key:k1" and keyed.implicit.startswith("retry:")
    with pytest.raises(APIError):
        key({"idempotency-key": "k" * 256}, {"prompt": "p"})


@pytest.mark.services
def test_file_lines_come_back_across_chunks_with_their_offsets(settings, api_database):
    db = create_engine(api_database)
    line = b'{"custom_id": "c%05d", "body": {"prompt": "%s"}}\n'
    content = b"".join(line % (i, b"x" * (i % 700)) for i in range(6000)) + b"tail without a newline"
    assert len(content) > 2 * FILE_CHUNK_BYTES  # lines cross the chunks' edges
    with db.begin() as conn:
        file_id = api_files.create(conn, "acme", "batch", "lines.jsonl", content)["file_id"]
    try:
        read = list(api_files.lines(db, file_id))
        assert b"".join(raw for raw, _ in read) == content
        assert [end for _, end in read] == [
            sum(len(raw) for raw, _ in read[: i + 1]) for i in range(len(read))
        ]
        middle = read[4000][1]  # resuming at a line's start reads the rest, as a batch's checkpoint does
        assert [raw for raw, _ in api_files.lines(db, file_id, middle)] == [raw for raw, _ in read[4001:]]
        cut = list(api_files.lines(db, file_id, max_line_bytes=100))  # an over-long line is cut, not held
        assert len(cut) == len(read) and all(len(raw) <= 101 for raw, _ in cut)
        assert [end for _, end in cut] == [end for _, end in read]
    finally:
        with db.begin() as conn:
            api_files.discard(conn, file_id)
        db.dispose()


def test_settings_read_the_round_two_options():
    from workers.settings import Settings

    env = {"INFERQ_API_REQUEST_TIMEOUT": "7", "INFERQ_API_GENERATION_TIMEOUT": "9",
           "INFERQ_API_CANCEL_ON_DISCONNECT": "no", "INFERQ_API_BAD_KEY_RPM": "0"}  # fmt: skip
    s = Settings.from_env(env)
    assert (s.api_queue_timeout_s, s.api_generation_timeout_s) == (7.0, 9.0)  # each wins over the shared one
    assert s.api_cancel_on_disconnect is False and s.api_bad_key_rpm == 0
    defaults = dataclasses.asdict(Settings.from_env({}))
    assert defaults["api_cancel_on_disconnect"] is True and defaults["api_max_body_bytes"] == 8 * 1024 * 1024
