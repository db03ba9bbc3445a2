"""A job's n samples and their logprobs through the persister: the jobs row's `choices` (jsonb) and the
published result, against the real PostgreSQL and Kafka."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from tests.workers.persistence_factories import admit_jobs, run_items, start_persister
from tests.workers.worker_factories import job_rows, now_ms, results_by_job
from workers.db.jobs import Terminal
from workers.serving.outbox.writes import Concluded

pytestmark = pytest.mark.services

ENTRY = {"token": "a", "logprob": -0.25, "bytes": [97], "top_logprobs": [{"token": "a", "logprob": -0.25,
                                                                          "bytes": [97]}]}  # fmt: skip


def test_choices_are_stored_as_jsonb_and_published_with_the_result(env):
    dep, db, producer = env
    since = now_ms()
    base = f"choices-{uuid.uuid4().hex[:8]}"
    many, one = f"{base}-n2", f"{base}-n1"
    admit_jobs(dep, db, "w-test", {many: 70, one: 71})
    now = datetime.now(UTC)
    choices = [
        {"index": 0, "text": "a", "finish_reason": "stop", "logprobs": {"content": [ENTRY]}},
        {"index": 1, "text": "b\u00e9", "finish_reason": "length", "logprobs": {"content": []}},
    ]
    common = {"finish_reason": "stop", "finished_at": now, "prompt_tokens": 4}
    topic = dep.topics.jobs("normal")
    many_row = {**common, "output_text": "a", "completion_tokens": 3, "choices": choices}
    one_row = {**common, "output_text": "solo", "completion_tokens": 1}
    items = [
        Concluded(Terminal(many, "succeeded", many_row, attempt=1, tenant="t-a"), ((topic, 0, 70),)),
        Concluded(Terminal(one, "succeeded", one_row, attempt=1, tenant="t-a"), ((topic, 0, 71),)),
    ]
    assert run_items(start_persister(dep, db, producer), items) == {(topic, 0, 70), (topic, 0, 71)}
    rows = job_rows(db, [many, one])
    assert rows[many]["choices"] == choices and rows[many]["output_text"] == "a"
    assert rows[one]["choices"] is None  # one sample, no logprobs: output_text says it all

    results = results_by_job(dep, since, 2)
    [result] = results[many]
    assert [c.model_dump() for c in result.choices] == choices
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (4, 3)
    [solo] = results[one]
    assert solo.output_text == "solo"
    assert [(c.index, c.text, c.finish_reason, c.logprobs) for c in solo.choices] == [
        (0, "solo", "stop", None)
    ]
