"""`inferq bulk-worker --log-format json`: Celery's own logging, start-up warnings included, as JSON lines."""

from __future__ import annotations

import json

import pytest

from tests.workers.bulk_factories import start_bulk_worker
from tests.workers.worker_factories import make_deployment

pytestmark = pytest.mark.services


def test_bulk_worker_logs_one_json_object_per_line(settings, tmp_path):
    dep = make_deployment(settings)
    worker = start_bulk_worker(dep, tmp_path / "state", tmp_path / "bulk.log", "--log-format", "json")
    try:
        lines = [line for line in worker.output().splitlines() if line.strip()]
    finally:
        assert worker.stop() == 0
    records = [json.loads(line) for line in lines]  # up to ready: every line is JSON (no banner)
    assert {r["worker_id"] for r in records} == {records[0]["worker_id"]}
    assert records[0]["worker_id"].startswith("bulk-")
    assert any(r["logger"].startswith("celery") and r["message"].endswith(" ready.") for r in records)
