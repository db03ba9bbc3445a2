"""Fail fast, never hang (issue 40, item 2): a job refused at any stage ends its request at once with the
reason (a stream's too); a queued stream says it is alive (SSE comments); the wait's two bounds (queued,
then generating) are separate settings.

The SDK clients here have no retries and a timeout of a minute: a stream that hung (as one of a refused job
did, for 10 minutes) fails these tests with a timeout instead of the refusal they expect.
"""

from __future__ import annotations

import json
import time

import httpx2 as httpx
import openai
import pytest

from tests.api.api_factories import MODEL, create_key, start_api
from tests.workers.worker_factories import make_deployment, start_worker

pytestmark = [pytest.mark.services, pytest.mark.slow]


def _client(api, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def test_a_too_long_streamed_prompt_is_refused_at_once_as_the_unstreamed_one_is(served):
    _, api, keys = served
    client = _client(api, keys["acme"])
    body = {"model": MODEL, "prompt": "x" * 5000}  # past the tiny model's 2048-token context
    with pytest.raises(openai.BadRequestError) as whole:
        client.completions.create(**body)
    with pytest.raises(openai.BadRequestError) as streamed:
        for _ in client.completions.create(**body, stream=True):
            pass
    assert "context" in streamed.value.message and streamed.value.message == whole.value.message
    assert streamed.value.response.headers["x-should-retry"] == "false"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "y" * 5000}]}
    with pytest.raises(openai.BadRequestError):
        for _ in client.chat.completions.create(**chat, stream=True):
            pass


def test_a_queued_stream_beats_until_its_job_is_refused_then_ends_with_the_reason(
    settings, api_database, tmp_path
):
    """No worker yet: the stream's answer starts (after its first second) and beats with SSE comments. A
    worker comes and refuses the job: the stream ends with the reason as an error event, at once."""
    import dataclasses

    dep = make_deployment(dataclasses.replace(settings, database_url=api_database))
    api = start_api(dep, tmp_path, INFERQ_API_HEARTBEAT="0.3", INFERQ_API_BAD_KEY_RPM="0")
    worker = None
    try:
        key = create_key(dep, "acme")
        body = {"model": MODEL, "prompt": "z" * 5000, "stream": True}
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.stream(
            "POST", f"{api.base_url}/v1/completions", json=body, headers=headers, timeout=120
        ) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            beats = 0
            while beats < 3:
                line = next(lines)
                assert line in (": keep-alive", ""), line  # nothing but beats while it waits
                beats += line == ": keep-alive"
            worker = start_worker(dep, tmp_path, "w-fail-fast", "--served-model-name", MODEL)
            events = [line for line in lines if line.startswith("data: ")]
        error = json.loads(events[0].removeprefix("data: "))["error"]
        assert "context" in error["message"] and error["code"] == "invalid_request"
        assert events[1:] == ["data: [DONE]"]
    finally:
        assert api.stop() == 0, api.output()[-3000:]
        if worker is not None:
            assert worker.stop() == 0, worker.output()[-3000:]


def test_the_queue_bound_and_the_generation_bound_are_apart(served, tmp_path):
    """A job that starts within the queue bound may generate for longer than it (the generation bound is
    its own); one that generates past the generation bound is a 504 naming the job, which goes on."""
    dep, _, keys = served
    patient = start_api(dep, tmp_path, INFERQ_API_QUEUE_TIMEOUT="3", INFERQ_API_GENERATION_TIMEOUT="300")
    hasty = start_api(dep, tmp_path, INFERQ_API_QUEUE_TIMEOUT="300", INFERQ_API_GENERATION_TIMEOUT="1")
    try:
        body = {"model": MODEL, "prompt": f"bounds {time.time()}", "max_tokens": 400, "temperature": 0,
                "logit_bias": {"2": -100}}  # fmt: skip
        # 400 tokens take the tiny model seconds past the 3 s queue bound: answered all the same
        answer = _client(patient, keys["acme"]).completions.create(**body)
        assert answer.usage.completion_tokens == 400
        with pytest.raises(openai.APIStatusError) as caught:
            _client(hasty, keys["acme"]).completions.create(**{**body, "prompt": f"bounds {time.time()}"})
        error = caught.value
        assert error.status_code == 504 and error.body["phase"] == "running"
        assert error.response.headers["x-should-retry"] == "true"
    finally:
        assert patient.stop() == 0, patient.output()[-3000:]
        assert hasty.stop() == 0, hasty.output()[-3000:]
