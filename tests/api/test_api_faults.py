"""Bad input and faults, on a deployment whose jobs never run (no worker): a batch that expires, a request
that times out (504 with its job id), an oversized upload, bad Batch requests."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.api.api_factories import MODEL, wait_batch
from tests.workers.worker_factories import read_topic

pytestmark = [pytest.mark.services, pytest.mark.slow]


def _line(i: int) -> str:
    body = {"model": MODEL, "prompt": f"line {i}", "max_tokens": 4}
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body})


def test_a_batch_past_its_window_expires_with_its_lines_in_the_error_file(idle):
    dep, api, key = idle
    client = api.client(key)
    since = int(time.time() * 1000) - 1000
    content = ("\n".join(_line(i) for i in range(3)) + "\n").encode()
    file_id = client.files.create(file=("in.jsonl", content), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    assert batch.expires_at - batch.created_at == 3  # the shortened window of this deployment
    batch = wait_batch(client, batch.id, ("expired", "completed", "failed"), timeout_s=60)
    assert batch.status == "expired" and batch.expired_at
    assert (batch.request_counts.total, batch.request_counts.failed) == (3, 3)
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        (f"c{i}", "batch_expired") for i in range(3)
    ]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
    key = batch.id.encode()
    records = read_topic(dep, dep.topics.batches, since, lambda rs: any(r.key == key for r in rs))
    assert [json.loads(r.value)["type"] for r in records if r.key == key] == ["batch.expired"]


def test_a_request_past_its_timeout_is_a_504_naming_its_job(idle):
    _, api, key = idle
    with pytest.raises(openai.APIStatusError) as caught:
        api.client(key).completions.create(model=MODEL, prompt="nobody serves this", max_tokens=4)
    assert caught.value.status_code == 504
    job_id = caught.value.body["job_id"]
    assert job_id.startswith("cmpl-") and job_id in caught.value.message


def test_an_oversized_file_is_refused_with_the_limit(idle):
    _, api, key = idle
    content = ("\n".join(_line(i) for i in range(200)) + "\n").encode()
    assert len(content) > 4096
    with pytest.raises(openai.APIStatusError) as caught:
        api.client(key).files.create(file=("big.jsonl", content), purpose="batch")
    assert caught.value.status_code == 413 and "4096" in caught.value.message
    assert caught.value.body["code"] == "file_too_large"


def test_bad_batch_requests(idle):
    _, api, key = idle
    client = api.client(key)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    file_id = client.files.create(file=("in.jsonl", (_line(0) + "\n").encode()), purpose="batch").id
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    assert caught.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="1h")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("in.jsonl", b"x"), purpose="fine-tune")
    unknown_model = json.dumps({"custom_id": "m", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "gpt-x", "prompt": "p"}})  # fmt: skip
    bad = client.files.create(file=("in.jsonl", unknown_model.encode()), purpose="batch").id
    batch = client.batches.create(input_file_id=bad, endpoint="/v1/completions", completion_window="24h")
    batch = wait_batch(client, batch.id, ("failed",), timeout_s=30)
    assert batch.errors.data[0].code == "model_not_found" and batch.errors.data[0].line == 1
