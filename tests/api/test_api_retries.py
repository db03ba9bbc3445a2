"""Retries that never duplicate (issue 40, item 3), through the official `openai` SDK: its own retry of a
request answered 504 reattaches to the job the first try posted; an `Idempotency-Key` names one job; every
error says whether a retry can help (`x-should-retry`, which the SDK obeys); a client that leaves cancels
its job, unless the deployment keeps such jobs."""

from __future__ import annotations

import time

import httpx2 as httpx
import openai
import pytest
from sqlalchemy import create_engine, text

from tests.api.api_factories import MODEL, raw, start_api

pytestmark = [pytest.mark.services, pytest.mark.slow]

LONG = {"max_tokens": 600, "temperature": 0, "logit_bias": {"2": -100}}  # seconds of the tiny model's time


def _rows(dep, prompt: str) -> list:
    db = create_engine(dep.database_url)
    try:
        with db.connect() as conn:
            return conn.execute(
                text("SELECT job_id, status FROM jobs WHERE prompt = :p ORDER BY created_at"), {"p": prompt}
            ).all()
    finally:
        db.dispose()


def _ended(dep, prompt: str, timeout_s: float = 180) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = _rows(dep, prompt)
        if rows and all(r.status not in ("queued", "running") for r in rows):
            return rows
        assert time.monotonic() < deadline, f"not ended: {rows}"
        time.sleep(0.3)


def test_the_sdks_retries_after_a_504_reattach_to_the_first_job(served, tmp_path):
    dep, _, keys = served
    api = start_api(dep, tmp_path, INFERQ_API_GENERATION_TIMEOUT="1")
    tries: list[str] = []
    http = httpx.Client(
        event_hooks={"request": [lambda r: tries.append(r.headers["x-stainless-retry-count"])]}
    )
    client = openai.OpenAI(
        base_url=f"{api.base_url}/v1", api_key=keys["acme"], max_retries=2, http_client=http
    )
    prompt = f"retried {time.time()}"
    try:
        try:  # each try waits 1 s of the job's generation (it takes seconds): a 504, then the SDK retries
            job_id = client.completions.create(model=MODEL, prompt=prompt, **LONG).id  # a retry got it
        except openai.APIStatusError as exc:
            assert exc.status_code == 504
            job_id = exc.body["job_id"]
        assert len(tries) >= 2 and tries == [str(i) for i in range(len(tries))]  # the SDK retried
        rows = _ended(dep, prompt)
        assert [(r.job_id, r.status) for r in rows] == [(job_id, "succeeded")]  # one job for every try
        # a first try of the same body (no retry count) is a request of its own: another job
        again = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key=keys["acme"], max_retries=0)
        with pytest.raises(openai.APIStatusError):
            again.completions.create(model=MODEL, prompt=prompt, **LONG)
        assert len(_ended(dep, prompt)) == 2
    finally:
        http.close()
        assert api.stop() == 0, api.output()[-3000:]


def test_an_idempotency_key_names_one_job_and_refuses_another_body(served):
    dep, api, keys = served
    client = api.client(keys["acme"])
    prompt = f"keyed {time.time()}"
    key = {"Idempotency-Key": f"k-{time.time()}"}
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, extra_headers=key)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, extra_headers=key)
    assert second.id == first.id and second.choices[0].text == first.choices[0].text
    assert len(_rows(dep, prompt)) == 1
    # a stream with a key of its own, sent again once its job ended: the same answer, replayed from the row
    streamed = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True}
    stream_key = {"Idempotency-Key": f"s-{time.time()}"}
    once = list(client.completions.create(**streamed, extra_headers=stream_key))
    twice = list(client.completions.create(**streamed, extra_headers=stream_key))
    assert {c.id for c in once} == {c.id for c in twice} and len(_rows(dep, prompt)) == 2
    assert "".join(c.choices[0].text for c in twice) == "".join(c.choices[0].text for c in once)
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.completions.create(model=MODEL, prompt=prompt + " and more", max_tokens=8, extra_headers=key)
    assert caught.value.body["code"] == "idempotency_key_reused"
    assert caught.value.response.headers["x-should-retry"] == "false"
    # the same key of another tenant is that tenant's own
    other = api.client(keys["globex"]).completions.create(
        model=MODEL, prompt="x", max_tokens=2, extra_headers=key
    )
    assert other.id != first.id


def test_every_error_says_whether_a_retry_can_help(served, idle):
    _, api, keys = served
    cases = [
        (f"{api.base_url}/v1/completions", keys["acme"], b"{not json", 400, "false"),
        (f"{api.base_url}/v1/models", "iq-not-a-key", None, 401, "false"),
        (f"{api.base_url}/v1/nothing", keys["acme"], None, 404, "false"),
    ]
    for url, key, body, status, retry in cases:
        request = httpx.Request("POST" if body else "GET", url, content=body,
                                headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        with httpx.Client() as http:
            answer = http.send(request)
        assert (answer.status_code, answer.headers["x-should-retry"]) == (status, retry), url
    _, idle_api, idle_key = idle  # no worker: its job is not answered within 2 s
    body = f'{{"model": "{MODEL}", "prompt": "nobody", "max_tokens": 2}}'.encode()
    with httpx.Client() as http:
        answer = http.post(f"{idle_api.base_url}/v1/completions", content=body,
                           headers={"Authorization": f"Bearer {idle_key}"})  # fmt: skip
    assert (answer.status_code, answer.headers["x-should-retry"]) == (504, "true")
    status, _ = raw(f"{api.base_url}/health")
    assert status == 200


@pytest.mark.parametrize("cancel", [True, False])
def test_a_client_that_leaves_cancels_its_job_unless_the_deployment_keeps_them(served, tmp_path, cancel):
    dep, _, keys = served
    api = start_api(dep, tmp_path, INFERQ_API_CANCEL_ON_DISCONNECT="1" if cancel else "0")
    prompt = f"left {cancel} {time.time()}"
    try:
        with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=1.5) as http:  # it leaves after 1.5 s
            http.post(f"{api.base_url}/v1/completions", headers={"Authorization": f"Bearer {keys['acme']}"},
                      json={"model": MODEL, "prompt": prompt, **LONG})  # fmt: skip
        [row] = _ended(dep, prompt)
        assert row.status == ("cancelled" if cancel else "succeeded")
    finally:
        assert api.stop() == 0, api.output()[-3000:]
