"""The API's pure parts, without services: live-request options, OpenAI's object shapes, the key cache."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from workers.api.auth import KeyCache
from workers.api.errors import APIError
from workers.api.protocol import batch_object, page, split_live_options
from workers.db.api_keys import key_hash


def test_live_options_are_taken_out_of_the_body():
    body, live = split_live_options(
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}, "priority": "high"}
    )
    assert body == {"prompt": "x"}
    assert (live.stream, live.include_usage, live.priority) == (True, True, "high")
    assert split_live_options({"prompt": "x"})[1].priority == "normal"
    # what current SDKs send: include_obfuscation is taken (no chunk carries obfuscation padding)
    options = {"include_usage": True, "include_obfuscation": False}
    assert split_live_options({"prompt": "x", "stream": True, "stream_options": options})[1].include_usage


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"priority": "urgent"}, "priority"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"chunk_size": 3}}, "stream_options.chunk_size"),
        ({"stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation"),
        ({"stream_options": []}, "stream_options"),
    ],
)
def test_bad_live_options_are_refused_by_name(extra, param):
    with pytest.raises(APIError) as caught:
        split_live_options({"prompt": "x", **extra})
    assert caught.value.status == 400 and caught.value.body()["error"]["param"] == param


def test_the_batch_object_has_openais_fields():
    at = datetime(2026, 12, 6, tzinfo=UTC)
    row = {
        "batch_id": "batch_1", "endpoint": "/v1/completions", "errors": [{"code": "x", "line": 2}],
        "input_file_id": "file-1", "completion_window": "24h", "status": "failed", "output_file_id": None,
        "error_file_id": None, "created_at": at, "expires_at": at, "metadata": {"a": "b"},
        **{f"{s}_at": None for s in ("in_progress", "finalizing", "completed", "failed", "expired",
                                     "cancelling", "cancelled")},
    }  # fmt: skip
    batch = batch_object(row, {"total": 3, "completed": 0, "failed": 0})
    assert batch["object"] == "batch" and batch["created_at"] == int(at.timestamp())
    assert batch["errors"] == {"object": "list", "data": [{"code": "x", "line": 2}]}
    assert set(batch) >= {"cancelling_at", "expired_at", "request_counts", "output_file_id", "error_file_id"}


def test_a_page_names_its_ends():
    listed = page([{"id": "a"}, {"id": "b"}], True)
    assert (listed["object"], listed["first_id"], listed["last_id"], listed["has_more"]) == (
        "list",
        "a",
        "b",
        True,
    )
    assert page([], False)["first_id"] is None


def test_the_key_cache_forgets_after_its_ttl():
    cache = KeyCache(ttl_s=0.0)
    cache.put(key_hash("iq-1"), "acme")
    assert cache.get(key_hash("iq-1")) is None  # expired at once
    cache = KeyCache(ttl_s=60.0)
    cache.put(key_hash("iq-1"), "acme")
    assert cache.get(key_hash("iq-1")) == "acme" and cache.get(key_hash("iq-2")) is None
