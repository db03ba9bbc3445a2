"""The official `openai` SDK against `inferq api`, a tiny-model worker, Kafka and PostgreSQL: models,
chat and completions (non-streamed and streamed), errors in OpenAI's shape, keys."""

from __future__ import annotations

import time
import urllib.request

import openai
import pytest
from sqlalchemy import create_engine, select

from schemas.tables import jobs
from tests.api.api_factories import MODEL, cli, create_key, raw
from tests.workers.worker_factories import wait_group_members
from workers.api.auth import KEY_CACHE_S

pytestmark = [pytest.mark.services, pytest.mark.slow]

CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say something"}], "max_tokens": 12}


def test_models_list_the_served_names(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-nothing")


def test_a_wrong_or_missing_key_is_refused_in_openais_shape(served):
    _, api, _ = served
    with pytest.raises(openai.AuthenticationError) as caught:
        api.client("iq-not-a-key").models.list()
    assert caught.value.status_code == 401
    assert caught.value.body["code"] == "invalid_api_key"
    status, body = raw(f"{api.base_url}/v1/models")
    assert status == 401
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_completion_streamed_equals_the_non_streamed_greedy_text(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.usage.completion_tokens == 16 and whole.choices[0].finish_reason == "length"
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_chat_streamed_equals_the_non_streamed_greedy_text(served):
    dep, api, keys = served
    client = api.client(keys["acme"])
    whole = client.chat.completions.create(**CHAT_BODY, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(**CHAT_BODY, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    # only the streamed answer's job asked the worker for token events
    db = create_engine(dep.database_url)
    with db.connect() as conn:
        rows = conn.execute(
            select(jobs.c.job_id, jobs.c.params).where(jobs.c.job_id.in_([whole.id, chunks[0].id]))
        )
        streamed = {job_id: params["stream"] for job_id, params in rows}
    db.dispose()
    assert streamed == {whole.id: False, chunks[0].id: True}


def test_job_options_and_priority_reach_the_job(served):
    dep, api, keys = served
    client = api.client(keys["acme"])
    answer = client.chat.completions.create(
        **CHAT_BODY, n=2, temperature=0.8, seed=7, logprobs=True, top_logprobs=2, stop=["\n\n"],
        extra_body={"priority": "high"},
    )  # fmt: skip
    assert [c.index for c in answer.choices] == [0, 1]
    assert len(answer.choices[0].logprobs.content[0].top_logprobs) == 2
    db = create_engine(dep.database_url)
    with db.connect() as conn:
        row = conn.execute(select(jobs).where(jobs.c.job_id == answer.id)).mappings().one()
    db.dispose()
    assert (row["tenant"], row["priority"], row["status"]) == ("acme", "high", "succeeded")
    sent = {"n": 2, "temperature": 0.8, "seed": 7, "logprobs": True, "top_logprobs": 2, "stop": ["\n\n"]}
    assert {name: row["params"].get(name) for name in sent} == sent  # the job ran with what was asked


def test_bad_requests_are_refused_by_name(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(**{**CHAT_BODY, "model": "gpt-unknown"})
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as caught:  # (tools are taken: tests/api/test_api_tools.py)
        client.chat.completions.create(**CHAT_BODY, audio={"voice": "alloy", "format": "wav"})
    assert caught.value.body["param"] == "audio" and "audio" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**CHAT_BODY, extra_body={"priority": "urgent"})
    assert caught.value.body["param"] == "priority"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    status, body = raw(f"{api.base_url}/v1/embeddings", "POST", keys["acme"], b"{}")
    assert status == 404 and body["error"]["code"] == "unknown_url"
    status, body = raw(f"{api.base_url}/v1/completions", "POST", keys["acme"], b"{not json")
    assert status == 400 and body["error"]["code"] == "invalid_json"


def test_a_client_that_disconnects_cancels_its_job(served):
    dep, api, keys = served
    stream = api.client(keys["acme"]).completions.create(
        model=MODEL, prompt="Go on and on", max_tokens=2000, stream=True
    )
    first = next(iter(stream))
    stream.close()
    db = create_engine(dep.database_url)
    deadline = time.monotonic() + 60
    status = None
    while time.monotonic() < deadline and status != "cancelled":
        with db.connect() as conn:
            status = conn.execute(select(jobs.c.status).where(jobs.c.job_id == first.id)).scalar_one_or_none()
        time.sleep(0.2)
    db.dispose()
    assert status == "cancelled"


def test_a_revoked_key_is_refused_from_then_on(served):
    dep, api, _ = served
    key = create_key(dep, "acme")
    client = api.client(key)
    assert client.models.list().data
    listed = cli(dep, "api-key", "list", "--tenant", "acme").stdout
    key_id = [line.split()[0] for line in listed.splitlines() if line.startswith("key_")][-1]
    assert cli(dep, "api-key", "revoke", key_id).returncode == 0
    time.sleep(KEY_CACHE_S)  # the process that saw the key live trusts it that long (auth.py)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_health_and_metrics(served):
    """The requests counted are this test's own: it passes alone, and counts exactly what it sent."""
    dep, api, keys = served
    wait_group_members(dep, 1)  # alone, its request may be the first: the worker up, not the client's timeout
    with urllib.request.urlopen(f"{api.base_url}/health") as r:
        assert r.status == 200
    ok = 'inferq_api_requests_total{method="POST",route="/v1/chat/completions",status="200"}'
    refused = 'inferq_api_requests_total{method="GET",route="/v1/models",status="401"}'
    timed = 'inferq_api_request_seconds_count{method="POST",route="/v1/chat/completions"}'
    before = _metrics(api.base_url)
    api.client(keys["acme"]).chat.completions.create(**CHAT_BODY, temperature=0)
    with pytest.raises(openai.AuthenticationError):
        api.client("iq-not-a-key").models.list()

    def counted() -> dict[str, float]:  # a request is counted just after its last byte: wait for that
        after = _metrics(api.base_url)
        return {n: after.get(n, 0.0) - before.get(n, 0.0) for n in (ok, refused, timed)}

    deadline = time.monotonic() + 30
    while min(counted().values()) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counted() == {ok: 1, refused: 1, timed: 1}


def _metrics(base_url: str) -> dict[str, float]:
    """The samples of /metrics, by name and labels."""
    with urllib.request.urlopen(f"{base_url}/metrics") as r:
        lines = r.read().decode().splitlines()
    return {name: float(value) for name, value in (ln.rsplit(" ", 1) for ln in lines if ln and ln[0] != "#")}
