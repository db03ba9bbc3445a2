"""Job ids belong to the tenant that first posted them; cancels are tenant-scoped, durable and race-free."""

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


def test_the_same_job_id_from_another_tenant_is_rejected_not_merged(deployment):
    dep, client, db, workers, _ = deployment
    since = now_ms()
    job_id = f"shared-id-{dep.topic_prefix}"
    client.submit({"job_id": job_id, "tenant": "acme", "prompt": "mine", "max_tokens": 200})
    client.flush()
    wait_status(db, job_id, "running")
    client.submit({"job_id": job_id, "tenant": "intruder", "prompt": "also mine?", "max_tokens": 5})
    client.flush()
    row = wait_terminal(db, [job_id])[job_id]
    assert (row["tenant"], row["status"], row["completion_tokens"]) == ("acme", "succeeded", 200)
    results = results_by_job(dep, since, 2)[job_id]
    by_tenant = {r.tenant: r for r in results}
    assert len(results) == 2 and set(by_tenant) == {"acme", "intruder"}
    assert by_tenant["intruder"].status == "rejected" and "another tenant" in by_tenant["intruder"].error
    assert client.wait(job_id, timeout_s=30, tenant="acme").status == "succeeded"


def test_only_the_owning_tenant_can_cancel(deployment):
    dep, client, db, workers, _ = deployment
    job_id = f"cancel-owner-{dep.topic_prefix}"
    client.submit({"job_id": job_id, "tenant": "acme", "prompt": "keep going", "max_tokens": 400})
    client.flush()
    wait_status(db, job_id, "running")
    client.cancel(job_id, tenant="intruder")
    client.cancel(f"unknown-{dep.topic_prefix}", tenant="intruder")
    row = wait_terminal(db, [job_id])[job_id]
    assert (row["status"], row["completion_tokens"]) == ("succeeded", 400)
    other = f"cancel-owner2-{dep.topic_prefix}"
    client.submit({"job_id": other, "tenant": "acme", "prompt": "stop me", "max_tokens": 2000})
    client.flush()
    wait_status(db, other, "running")
    client.cancel(other, tenant="acme")
    assert wait_terminal(db, [other])[other]["status"] == "cancelled"


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
