"""Per-tenant limits (workers/api/limits.py) through the `openai` SDK: over a limit, RateLimitError (429 in
OpenAI's shape) with Retry-After; another tenant is not held back; a finished stream gives its place back.

The API processes here run on the deployment without a worker (jobs stay queued), so a stream holds its
place for as long as the test keeps it open. The SDK's own retries are off (max_retries=0).
"""

from __future__ import annotations

import time

import openai
import pytest

from tests.api.api_factories import MODEL, create_key, start_api
from workers.api.errors import APIError
from workers.api.limits import TenantLimits


def test_limits_are_off_by_default():
    limits = TenantLimits()
    slots = [limits.hold("acme") for _ in range(1000)]
    for _ in range(1000):
        limits.admit("acme")
    assert limits.in_flight("acme") == 0
    for slot in slots:
        slot.release()


def test_a_slot_given_back_twice_counts_once():
    limits = TenantLimits(max_in_flight=2)
    first, second = limits.hold("acme"), limits.hold("acme")
    with pytest.raises(APIError) as raised:
        limits.hold("acme")
    assert raised.value.status == 429 and raised.value.headers["Retry-After"] == "1"
    limits.hold("globex").release()  # another tenant's places are its own
    first.release()
    first.release()
    assert limits.in_flight("acme") == 1
    limits.hold("acme")
    with pytest.raises(APIError):
        limits.hold("acme")
    second.release()


def test_requests_per_minute_refuse_past_the_bucket_with_the_wait():
    limits = TenantLimits(requests_per_minute=60)
    for _ in range(60):
        limits.admit("acme")
    with pytest.raises(APIError) as raised:
        limits.admit("acme")
    assert raised.value.body()["error"]["code"] == "rate_limit_exceeded"
    assert raised.value.headers["Retry-After"] == "1"  # one request a second refills
    limits.admit("globex")


def _chat(client: openai.OpenAI, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, **extra
    )


@pytest.mark.services
@pytest.mark.slow
def test_a_tenant_over_its_requests_in_flight_gets_429_until_one_ends(idle, tmp_path):
    dep, _, acme_key = idle
    api = start_api(dep, tmp_path, INFERQ_API_TENANT_MAX_IN_FLIGHT="1", INFERQ_API_REQUEST_TIMEOUT="2")
    try:
        acme, globex = api.client(acme_key), api.client(create_key(dep, "globex"))
        stream = _chat(acme, stream=True)  # queued (no worker): in flight until closed
        with pytest.raises(openai.RateLimitError) as raised:
            _chat(acme)
        error = raised.value
        assert error.status_code == 429
        assert error.body["code"] == "concurrency_limit_exceeded"
        assert error.body["type"] == "rate_limit_error"
        assert int(error.response.headers["retry-after"]) >= 1
        # another tenant has a place of its own: it gets past the limit (and waits for its job: 504)
        with pytest.raises(openai.InternalServerError) as timed_out:
            _chat(globex)
        assert timed_out.value.status_code == 504
        stream.close()  # the client leaves: the stream ends and gives its place back
        deadline = time.monotonic() + 30
        while True:
            try:
                _chat(acme)
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "the closed stream never gave its place back"
                time.sleep(0.5)
                continue
            except openai.InternalServerError as exc:
                assert exc.status_code == 504  # past the limit: its job waited (no worker)
                break
            raise AssertionError("a job was answered without a worker")
    finally:
        assert api.stop() == 0, api.output()[-3000:]


@pytest.mark.services
@pytest.mark.slow
def test_a_tenant_over_its_requests_per_minute_gets_429_with_retry_after(idle, tmp_path):
    dep, _, acme_key = idle
    api = start_api(dep, tmp_path, INFERQ_API_TENANT_RPM="2")
    try:
        acme, globex = api.client(acme_key), api.client(create_key(dep, "globex"))
        # (no worker runs here: the models list is empty, and any /v1 request counts)
        assert acme.models.list().data == []
        acme.files.list()
        with pytest.raises(openai.RateLimitError) as raised:
            acme.models.list()
        error = raised.value
        assert error.body["code"] == "rate_limit_exceeded"
        assert "requests per minute" in error.body["message"]
        # one more request is allowed 60/2 = 30 s after the bucket emptied
        assert 1 <= int(error.response.headers["retry-after"]) <= 30
        assert error.response.headers["x-ratelimit-limit-requests"] == "2"
        assert globex.models.list().data == []  # another tenant: a bucket of its own
    finally:
        assert api.stop() == 0, api.output()[-3000:]
