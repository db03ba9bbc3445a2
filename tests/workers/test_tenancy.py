"""Job ids are scoped by tenant: two tenants' jobs of one id are two jobs; cancels are tenant-scoped,
durable and race-free, and a cancel for an id nobody has yet blocks no other tenant."""

from __future__ import annotations

import signal

import pytest
from sqlalchemy import create_engine

from tests.workers.worker_factories import (
    job_rows,
    make_deployment,
    now_ms,
    results_by_job,
    start_worker,
    wait_group_members,
    wait_status,
    wait_tenant_rows,
    wait_terminal,
)
from workers.client import JobClient

pytestmark = [pytest.mark.services, pytest.mark.slow]


@pytest.fixture
def deployment(settings, tmp_path):
    dep = make_deployment(settings)
    client = JobClient(dep)
    db = create_engine(dep.database_url)
    workers = [start_worker(dep, tmp_path, "w-tenancy")]
    wait_group_members(dep, 1)
    try:
        yield dep, client, db, workers, tmp_path
    finally:
        client.close()
        for w in workers:
            w.stop(signal.SIGTERM)
        db.dispose()


def test_two_tenants_may_use_the_same_job_id_and_both_jobs_run(deployment):
    dep, client, db, workers, _ = deployment
    since = now_ms()
    job_id = f"shared-id-{dep.topic_prefix}"
    client.submit({"job_id": job_id, "tenant": "acme", "prompt": "mine", "max_tokens": 200})
    client.flush()
    wait_status(db, job_id, "running")
    client.submit({"job_id": job_id, "tenant": "other", "prompt": "also mine", "max_tokens": 5})
    client.flush()
    rows = wait_tenant_rows(db, job_id, {"acme", "other"})
    assert {t: (r["status"], r["completion_tokens"]) for t, r in rows.items()} == {
        "acme": ("succeeded", 200),
        "other": ("succeeded", 5),
    }
    results = {r.tenant: r for r in results_by_job(dep, since, 2)[job_id]}
    assert {t: (r.status, r.usage.completion_tokens) for t, r in results.items()} == {
        "acme": ("succeeded", 200),
        "other": ("succeeded", 5),
    }
    assert results["acme"].output_text == rows["acme"]["output_text"] != rows["other"]["output_text"]
    assert client.wait(job_id, timeout_s=30, tenant="other").usage.completion_tokens == 5


def test_only_the_owning_tenant_can_cancel(deployment):
    dep, client, db, workers, _ = deployment
    job_id = f"cancel-owner-{dep.topic_prefix}"
    client.submit({"job_id": job_id, "tenant": "acme", "prompt": "keep going", "max_tokens": 400})
    client.flush()
    wait_status(db, job_id, "running")
    client.cancel(job_id, tenant="intruder")
    client.cancel(f"unknown-{dep.topic_prefix}", tenant="intruder")
    row = wait_tenant_rows(db, job_id, {"acme"})["acme"]
    assert (row["status"], row["completion_tokens"]) == ("succeeded", 400)
    other = f"cancel-owner2-{dep.topic_prefix}"
    client.submit({"job_id": other, "tenant": "acme", "prompt": "stop me", "max_tokens": 2000})
    client.flush()
    wait_status(db, other, "running")
    client.cancel(other, tenant="acme")
    assert wait_terminal(db, [other])[other]["status"] == "cancelled"


def test_a_cancel_for_an_unknown_id_blocks_no_other_tenant(deployment):
    """A tenant that cancels an id nobody has used yet (ids are predictable: derived ones, bulk ones)
    gets a `cancelled` row of its own; the tenant that then posts a job of that id runs it."""
    dep, client, db, workers, _ = deployment
    job_id = f"squat-{dep.topic_prefix}"
    client.cancel(job_id, tenant="squatter")
    assert wait_tenant_rows(db, job_id, {"squatter"})["squatter"]["status"] == "cancelled"
    client.submit({"job_id": job_id, "tenant": "acme", "prompt": "my id", "max_tokens": 7})
    rows = wait_tenant_rows(db, job_id, {"squatter", "acme"})
    assert {t: r["status"] for t, r in rows.items()} == {"squatter": "cancelled", "acme": "succeeded"}
    assert rows["acme"]["completion_tokens"] == 7
    assert client.wait(job_id, timeout_s=60, tenant="acme").status == "succeeded"


def test_a_cancel_sent_just_before_its_job_always_ends_it(deployment):
    dep, client, db, workers, _ = deployment
    ids = [f"race-{dep.topic_prefix}-{i}" for i in range(10)]
    for job_id in ids:  # no pause between the cancel and the job: they race through two topics
        client.cancel(job_id, tenant="acme")
        client.submit({"job_id": job_id, "tenant": "acme", "prompt": "never", "max_tokens": 50})
    client.flush()
    rows = wait_terminal(db, ids)
    assert {r["status"] for r in rows.values()} == {"cancelled"}
    # read in the same poll, the cancel keeps the job from starting; if the two topics' fetches come
    # apart, the job may run for a step or two before the cancel arrives, never to its end
    assert all((r["completion_tokens"] or 0) < 50 for r in rows.values())


def test_a_cancel_sent_while_no_worker_runs_is_honoured_after_restart(deployment):
    dep, client, db, workers, tmp = deployment
    job_id = f"durable-{dep.topic_prefix}"
    client.submit({"job_id": job_id, "tenant": "acme", "prompt": "long", "max_tokens": 2000})
    client.flush()
    wait_status(db, job_id, "running")
    workers[0].stop(signal.SIGKILL)
    client.cancel(job_id, tenant="acme")  # nobody is listening
    workers.append(start_worker(dep, tmp, "w-restarted"))
    row = wait_terminal(db, [job_id])[job_id]
    assert row["status"] == "cancelled" and (row["completion_tokens"] or 0) < 2000
    assert job_rows(db, [job_id])[job_id]["cancel_requested_at"] is not None
