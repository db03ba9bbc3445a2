"""Batches, round two (issue 40, items 1 and 4), through the official `openai` SDK: batches of different
tenants advance fairly (a large batch never has more than its window of jobs in the queue, so another
tenant's small batch is not held behind it), and a batch says its model and usage, its output lines their
cached tokens and the request's time. A deployment of its own: no other API process drives its batches."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from sqlalchemy import create_engine, text

from tests.api.api_factories import MODEL, create_key, start_api, wait_batch, wait_models
from tests.workers.worker_factories import make_deployment, start_worker

pytestmark = [pytest.mark.services, pytest.mark.slow]

WINDOW = 16


@pytest.fixture(scope="module")
def rounds(settings, api_database, tmp_path_factory):
    dep = make_deployment(dataclasses.replace(settings, database_url=api_database))
    tmp = tmp_path_factory.mktemp("api-rounds")
    worker = start_worker(dep, tmp, "w-rounds", "--served-model-name", MODEL)
    api = start_api(dep, tmp, INFERQ_API_BATCH_IN_FLIGHT=str(WINDOW))
    keys = {t: create_key(dep, t) for t in ("acme", "globex")}
    try:
        wait_models(api, keys["acme"], [MODEL])
        yield dep, api, keys
    finally:
        code = api.stop()
        assert worker.stop() == 0, worker.output()[-3000:]
        assert code == 0, api.output()[-3000:]


def _content(n: int, tag: str, **body) -> bytes:
    lines = (
        {"custom_id": f"{tag}{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": f"{tag} line {i}", "max_tokens": 2, **body}}
        for i in range(n)
    )  # fmt: skip
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode()


def test_a_small_batch_of_another_tenant_is_not_held_behind_a_large_one(rounds):
    dep, api, keys = rounds
    acme, globex = api.client(keys["acme"]), api.client(keys["globex"])
    large_file = acme.files.create(file=("large.jsonl", _content(1500, "a")), purpose="batch")
    large = acme.batches.create(
        input_file_id=large_file.id, endpoint="/v1/completions", completion_window="24h"
    )
    wait_batch(acme, large.id, ("in_progress",))
    small_file = globex.files.create(file=("small.jsonl", _content(10, "g")), purpose="batch")
    small = globex.batches.create(
        input_file_id=small_file.id, endpoint="/v1/completions", completion_window="24h"
    )
    db = create_engine(dep.database_url)
    most_queued = 0
    try:
        deadline = time.monotonic() + 300
        while (done := globex.batches.retrieve(small.id)).status not in ("completed", "failed"):
            with db.connect() as conn:  # the large batch's jobs handed to Kafka and not ended yet
                submitted = conn.execute(text("SELECT submitted FROM api_batches WHERE batch_id = :b"),
                                         {"b": large.id}).scalar_one()  # fmt: skip
                ended = conn.execute(
                    text(
                        "SELECT count(*) FROM jobs WHERE bulk_id = :b AND status NOT IN ('queued', 'running')"
                    ),
                    {"b": large.id},
                ).scalar_one()
            most_queued = max(most_queued, submitted - ended)
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        db.dispose()
    assert done.status == "completed" and done.request_counts.completed == 10
    behind = acme.batches.retrieve(large.id)
    assert behind.status == "in_progress" and behind.request_counts.completed < 1500  # it did not wait for it
    assert most_queued <= WINDOW  # the large batch never had more than its window in the queue
    acme.batches.cancel(large.id)


def test_a_batch_says_its_model_and_usage_and_its_lines_their_time_and_cached_tokens(rounds):
    dep, api, keys = rounds
    client = api.client(keys["acme"])
    preamble = "A preamble long enough to fill a few blocks of the prefix cache. " * 2
    content = _content(6, "u", prompt=preamble + "go")
    client.completions.create(model=MODEL, prompt=preamble + "go", max_tokens=1)  # its blocks now cached
    source = client.files.create(file=("usage.jsonl", content), purpose="batch")
    created = time.time()
    batch = client.batches.create(
        input_file_id=source.id, endpoint="/v1/completions", completion_window="24h"
    )
    done = wait_batch(client, batch.id, ("completed", "failed"))
    assert done.status == "completed" and done.model == MODEL
    lines = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    bodies = [line["response"]["body"] for line in lines]
    usage = done.usage
    assert usage.input_tokens == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert usage.output_tokens == sum(b["usage"]["completion_tokens"] for b in bodies) == 12
    cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies]
    assert usage.input_tokens_details.cached_tokens == sum(cached) > 0
    db = create_engine(dep.database_url)
    with db.connect() as conn:
        posted = dict(
            conn.execute(
                text("SELECT job_id, created_at FROM jobs WHERE bulk_id = :b"), {"b": batch.id}
            ).all()
        )
    db.dispose()
    assert [b["created"] for b in bodies] == [int(posted[b["id"]].timestamp()) for b in bodies]  # when posted
    assert all(created - 1 <= b["created"] for b in bodies)
