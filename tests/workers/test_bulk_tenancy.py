"""A bulk job collects its own tenant's jobs only: another tenant's jobs under the bulk job's (predictable)
job ids and bulk_id neither land in its output file nor count as its progress."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas.tables import jobs
from tests.workers.bulk_factories import numbered_batch, read_jsonl
from workers.bulk.advance import write_files
from workers.bulk.batch_format import job_id_for
from workers.db import bulk_jobs as store

pytestmark = pytest.mark.services


def test_another_tenants_jobs_of_a_bulk_jobs_ids_stay_out_of_its_files(db_engine, tmp_path):
    bulk_id = store.new_bulk_id()
    path = numbered_batch(tmp_path / "input.jsonl", 2)
    first, second = (job_id_for(bulk_id, f"req-{i:04d}") for i in range(2))
    now = datetime.now(UTC)

    def row(job_id: str, tenant: str, text: str) -> dict:
        return dict(job_id=job_id, tenant=tenant, priority="low", status="succeeded", bulk_id=bulk_id,
                    output_text=text, finish_reason="stop", prompt_tokens=3, completion_tokens=2,
                    created_at=now, finished_at=now)  # fmt: skip

    with db_engine.begin() as conn:
        store.create(conn, bulk_id, tenant="acme", input_path=str(path), total_lines=2)
        store.transition(conn, bulk_id, ("submitting",), "finalizing")
        conn.execute(jobs.insert().values(row(first, "acme", "acme's answer")))
        # the intruder posted jobs under the bulk job's ids (and its bulk_id), one the owner never ran
        conn.execute(jobs.insert().values(row(first, "intruder", "planted")))
        conn.execute(jobs.insert().values(row(second, "intruder", "planted too")))
    with db_engine.connect() as conn:
        bulk = store.get(conn, bulk_id)
        assert store.job_counts(conn, bulk_id, "acme") == {"succeeded": 1}
        progress = store.progress(conn, bulk_id)  # the bulk_progress view
        assert (progress["jobs"], progress["succeeded"], progress["completion_tokens"]) == (1, 1, 2)
    counts = write_files(db_engine, bulk)
    assert (counts.succeeded, counts.unfinished) == (1, 1)
    [out] = read_jsonl(tmp_path / "output.jsonl")
    assert out["custom_id"] == "req-0000"
    assert out["response"]["body"]["choices"][0]["text"] == "acme's answer"
    [err] = read_jsonl(tmp_path / "errors.jsonl")
    assert err["custom_id"] == "req-0001" and "planted" not in str(err)
    with db_engine.begin() as conn:
        conn.execute(jobs.delete().where(jobs.c.bulk_id == bulk_id))
        conn.execute(store.bulk_jobs.delete().where(store.bulk_jobs.c.bulk_id == bulk_id))
