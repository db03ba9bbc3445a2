"""The Batch API through the `openai` SDK: files, an 8-line batch end to end, a broken line, cancel, expiry,
pagination, tenancy, lifecycle events on Kafka."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.api.api_factories import MODEL, cli, create_key, raw, wait_batch
from tests.workers.worker_factories import read_topic
from workers.api.auth import KEY_CACHE_S

pytestmark = [pytest.mark.services, pytest.mark.slow]


def chat_line(i: int, **body) -> dict:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Line {i}: hello"}],
            "max_tokens": 10,
            **body,
        },  # fmt: skip
    }


def upload(client: openai.OpenAI, lines: list) -> str:
    content = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    return client.files.create(file=("input.jsonl", content.encode()), purpose="batch").id


def test_an_8_line_batch_answers_as_the_synchronous_calls(served):
    dep, api, keys = served
    client = api.client(keys["acme"])
    since = int(time.time() * 1000) - 1000
    lines = [chat_line(i, temperature=0) for i in range(8)]
    file_id = upload(client, lines)
    assert client.files.retrieve(file_id).purpose == "batch"
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "8"}
    )
    assert batch.status == "validating" and batch.metadata == {"run": "8"}
    batch = wait_batch(client, batch.id, ("completed", "failed"))
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        8,
        8,
        0,
    )
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.error_file_id is None
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == [f"req-{i}" for i in range(8)]
    for line, answer in zip(lines, output, strict=True):
        sync = client.chat.completions.create(**line["body"])
        body = answer["response"]["body"]
        assert answer["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == sync.choices[0].message.content
        assert body["usage"]["completion_tokens"] == sync.usage.completion_tokens

    records = read_topic(
        dep, dep.topics.batches, since, lambda rs: any(r.key == batch.id.encode() for r in rs)
    )
    event = next(json.loads(r.value) for r in records if r.key == batch.id.encode())
    assert event["type"] == "batch.completed" and event["batch"]["request_counts"]["completed"] == 8


def test_the_lines_are_low_priority_jobs_rows_of_the_batch(served):
    dep, api, keys = served
    client = api.client(keys["acme"])
    batch = client.batches.create(
        input_file_id=upload(client, [chat_line(i) for i in range(3)]),
        endpoint="/v1/chat/completions", completion_window="24h",
    )  # fmt: skip
    wait_batch(client, batch.id, ("completed",))
    from sqlalchemy import create_engine, select

    from schemas.tables import jobs

    db = create_engine(dep.database_url)
    with db.connect() as conn:
        rows = conn.execute(select(jobs).where(jobs.c.bulk_id == batch.id)).mappings().all()
    db.dispose()
    assert len(rows) == 3
    assert {(r["priority"], r["tenant"], r["status"]) for r in rows} == {("low", "acme", "succeeded")}


def test_a_broken_line_fails_the_batch_naming_the_line(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    lines = [chat_line(0), chat_line(1), '{"custom_id": "req-2", "method": "POST", "url": ', chat_line(3)]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_batch(client, batch.id, ("failed", "completed"))
    assert batch.status == "failed" and batch.failed_at
    assert [(e.line, e.code) for e in batch.errors.data] == [(3, "invalid_request")]
    assert "not JSON" in batch.errors.data[0].message
    wrong_endpoint = client.batches.create(
        input_file_id=upload(client, [chat_line(0)]), endpoint="/v1/completions", completion_window="24h"
    )
    assert wait_batch(client, wrong_endpoint.id, ("failed",)).errors.data[0].code == "invalid_url"


def test_a_cancelled_batch_keeps_the_lines_done_so_far(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    lines = [chat_line(i, max_tokens=1500) for i in range(12)]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_batch(client, batch.id, ("in_progress",))
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = wait_batch(client, batch.id, ("cancelled",), timeout_s=120)
    counts = batch.request_counts
    assert counts.total == 12 and counts.completed + counts.failed == 12 and counts.failed > 0
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert len(errors) == counts.failed  # a line for each request that failed, none left out
    assert {e["error"]["code"] for e in errors} <= {"cancelled", "batch_cancelled"}
    done = client.files.content(batch.output_file_id).text.splitlines() if batch.output_file_id else []
    assert len(done) == counts.completed
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: the same answer
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(_completed_batch(client))


def _completed_batch(client: openai.OpenAI) -> str:
    batch = client.batches.create(
        input_file_id=upload(client, [chat_line(0)]), endpoint="/v1/chat/completions", completion_window="24h"
    )
    return wait_batch(client, batch.id, ("completed",)).id


def test_pagination_of_batches_and_files(served):
    _, api, keys = served
    client = api.client(keys["globex"])
    made, inputs = [], []
    for i in range(3):
        inputs.append(upload(client, [chat_line(i)]))
        made.append(
            client.batches.create(
                input_file_id=inputs[-1], endpoint="/v1/chat/completions", completion_window="24h"
            ).id
        )
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert made[0] in [b.id for b in rest.data]
    assert [b.id for b in client.batches.list(limit=100)][:3] == made[::-1]
    # the tenant's input files, newest first: this test's three lead (other tests' are older)
    files = client.files.list(purpose="batch", limit=2)
    assert [f.id for f in files.data] == inputs[::-1][:2] and files.has_more
    rest_files = client.files.list(purpose="batch", limit=2, after=files.data[-1].id)
    assert [f.id for f in rest_files.data][:1] == inputs[:1]


def test_one_tenants_key_cannot_reach_another_tenants_batch_or_files(served):
    _, api, keys = served
    acme, globex = api.client(keys["acme"]), api.client(keys["globex"])
    file_id = upload(acme, [chat_line(0)])
    batch = acme.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with pytest.raises(openai.NotFoundError):
        globex.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        globex.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        globex.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        globex.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        globex.files.delete(file_id)
    with pytest.raises(openai.NotFoundError):  # nor start a batch on its file
        globex.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.id not in [b.id for b in globex.batches.list(limit=100)]
    assert file_id not in [f.id for f in globex.files.list()]
    done = wait_batch(acme, batch.id, ("completed",))
    with pytest.raises(openai.NotFoundError):
        globex.files.content(done.output_file_id)


def test_files_can_be_deleted_once_no_batch_reads_them(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    file_id = upload(client, [chat_line(0)])
    assert client.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)
    status, body = raw(f"{api.base_url}/v1/batches/batch_nope", key=keys["acme"])
    assert status == 404 and body["error"]["code"] == "batch_not_found"


def test_a_key_revoked_mid_batch_stops_that_key_not_the_tenants_batch(served):
    dep, api, keys = served
    key = create_key(dep, "acme")
    client, other = api.client(key), api.client(keys["acme"])  # other: the tenant's other key
    listed = cli(dep, "api-key", "list", "--tenant", "acme").stdout
    key_id = [line.split()[0] for line in listed.splitlines() if line.startswith("key_")][-1]
    lines = [chat_line(i, max_tokens=1500) for i in range(8)]  # long enough to outlast the revoke
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_batch(client, batch.id, ("in_progress",))
    assert cli(dep, "api-key", "revoke", key_id).returncode == 0
    running = other.batches.retrieve(batch.id)  # mid-batch indeed: the revoke did not wait for its end
    counts = running.request_counts
    assert running.status == "in_progress" and counts.completed + counts.failed < counts.total == 8
    time.sleep(KEY_CACHE_S)  # the process that saw the key live trusts it that long (auth.py)
    with pytest.raises(openai.AuthenticationError):
        client.batches.retrieve(batch.id)
    done = wait_batch(other, batch.id, ("completed", "failed", "cancelled"))
    assert done.status == "completed" and done.request_counts.completed == 8
