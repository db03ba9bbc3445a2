"""An API process killed (SIGKILL) mid-stream and mid-batch: what it leaves behind, and another process
carrying on. A deployment of their own (one tiny-model worker), so that no other API process's batch
driver reaches for the batch first.

Mid-stream: nobody cancels the job (the process that would have is gone), so the worker runs it to its end
(max_tokens: finish_reason `length`) and its row is terminal once; a new API process answers the same key's
`GET /v1/chat/completions/{id}` from that row, equal to a synchronous greedy call of the same body.

Mid-batch: the process dies (failpoint) right after its driver's first checkpoint, holding the batch's
advisory lock; PostgreSQL drops the lock with its connection, and a new process's driver produces the rest
from the checkpoint (job ids are the lines', so nothing runs twice) and completes the batch.
"""

from __future__ import annotations

import dataclasses
import json
import time

import openai
import pytest
from sqlalchemy import create_engine, text

from tests.api.api_factories import MODEL, create_key, start_api, wait_batch
from tests.workers.worker_factories import make_deployment, start_worker
from workers.api.batch_driver import CHECKPOINT_LINES, KILL_AFTER_CHECKPOINT

pytestmark = [pytest.mark.services, pytest.mark.slow]

TERMINAL = ("succeeded", "failed", "cancelled", "rejected", "expired")


@pytest.fixture(scope="module")
def fleet(settings, api_database, tmp_path_factory):
    dep = make_deployment(dataclasses.replace(settings, database_url=api_database))
    tmp = tmp_path_factory.mktemp("api-takeover")
    worker = start_worker(dep, tmp, "w-takeover", "--served-model-name", MODEL)
    db = create_engine(api_database)
    try:
        wait_announced(db, dep.topic_prefix, MODEL)  # the worker serves: a job runs at once
        yield dep, db, create_key(dep, "acme")
    finally:
        db.dispose()
        assert worker.stop() == 0, worker.output()[-3000:]


def wait_announced(db, topic_prefix: str, model: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not _rows(db, "SELECT 1 FROM served_models WHERE topic_prefix = :p AND model = :m", p=topic_prefix,
                    m=model):  # fmt: skip
        assert time.monotonic() < deadline, "the worker never announced its model"
        time.sleep(0.3)


def _rows(db, query: str, **params) -> list:
    with db.connect() as conn:
        return conn.execute(text(query), params).all()


def test_an_api_process_killed_mid_stream_leaves_one_finished_job_another_finds(fleet, tmp_path):
    dep, db, key = fleet
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 160,
            "temperature": 0}  # fmt: skip
    first = start_api(dep, tmp_path)
    try:
        stream = first.client(key).chat.completions.create(**body, stream=True)
        chunk = next(iter(stream))  # the stream has begun: its job is running
        job_id = chunk.id
    finally:
        first.proc.kill()  # SIGKILL: no shutdown, no cancel of the stream's job
        first.proc.wait(30)
    [(status,)] = _rows(db, "SELECT status FROM jobs WHERE job_id = :j", j=job_id)
    assert status not in TERMINAL  # killed before its job ended

    second = start_api(dep, tmp_path)
    try:
        client = second.client(key)
        deadline = time.monotonic() + 120
        while True:
            try:
                found = client.chat.completions.retrieve(job_id)
                break
            except openai.ConflictError as exc:  # 409 job_not_finished: still running
                assert exc.body["code"] == "job_not_finished"
                assert time.monotonic() < deadline, "the job never finished"
                time.sleep(0.3)
        assert found.id == job_id and found.object == "chat.completion"
        # nobody cancelled it: it ran to max_tokens
        assert found.choices[0].finish_reason == "length"
        assert found.usage.completion_tokens == body["max_tokens"]
        again = client.chat.completions.create(**body)  # greedy: the same text
        assert found.choices[0].message.content == again.choices[0].message.content
        rows = _rows(db, "SELECT tenant, status, attempts FROM jobs WHERE job_id = :j", j=job_id)
        assert [(r.tenant, r.status) for r in rows] == [("acme", "succeeded")]
        with pytest.raises(openai.NotFoundError):  # another tenant's key does not find it
            second.client(create_key(dep, "globex")).chat.completions.retrieve(job_id)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.retrieve("chatcmpl-nosuchjob")
    finally:
        assert second.stop() == 0, second.output()[-3000:]


def test_an_api_process_killed_mid_batch_is_taken_over_by_another(fleet, tmp_path):
    dep, db, key = fleet
    total = CHECKPOINT_LINES + 50
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": f"line {i}", "max_tokens": 2, "temperature": 0}}
        for i in range(total)
    ]  # fmt: skip
    content = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()
    first = start_api(dep, tmp_path, INFERQ_FAILPOINT=KILL_AFTER_CHECKPOINT)
    try:
        client = first.client(key)
        file_id = client.files.create(file=("in.jsonl", content), purpose="batch").id
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
        assert first.proc.wait(120) == -9  # its driver killed it after the first checkpoint
    finally:
        first.stop()
    [(status, submitted)] = _rows(
        db, "SELECT status, submitted FROM api_batches WHERE batch_id = :b", b=batch.id
    )
    assert (status, submitted) == ("in_progress", CHECKPOINT_LINES)

    second = start_api(dep, tmp_path)
    try:
        client = second.client(key)
        done = wait_batch(client, batch.id, ("completed", "failed", "expired", "cancelled"), timeout_s=400)
        assert done.status == "completed"
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (total, total, 0)
        output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in output) == sorted(f"c{i}" for i in range(total))
        assert all(o["response"]["status_code"] == 200 for o in output)
        rows = _rows(db, "SELECT job_id, status FROM jobs WHERE bulk_id = :b", b=batch.id)
        assert len(rows) == len({r.job_id for r in rows}) == total  # one row a line: none produced twice
        assert {r.status for r in rows} == {"succeeded"}
        [(submitted,)] = _rows(db, "SELECT submitted FROM api_batches WHERE batch_id = :b", b=batch.id)
        assert submitted == total  # the rest produced by the second process
    finally:
        assert second.stop() == 0, second.output()[-3000:]
