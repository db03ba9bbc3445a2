"""Bulk jobs end to end: `inferq bulk ...`, a Celery bulk worker and an inference worker, all real.

Each module run has its own topic prefix (so its own Celery queue and consumer group) and state dir.
"""

from __future__ import annotations

import json
import signal
import stat

import pytest
from sqlalchemy import create_engine, select

from schemas.tables import jobs
from tests.services.factories import run_cli
from tests.workers.bulk_factories import (
    batch_line,
    bulk_row,
    cli_env,
    numbered_batch,
    read_jsonl,
    start_bulk_worker,
    wait_bulk,
    write_batch,
)
from tests.workers.worker_factories import make_deployment, start_worker

pytestmark = [pytest.mark.services, pytest.mark.slow]


@pytest.fixture(scope="module")
def dep(settings, tmp_path_factory):
    """(settings, env, db, tmp, bulk worker) of a private deployment with one inference worker."""
    deployment = make_deployment(settings)
    tmp = tmp_path_factory.mktemp("bulk")
    env = cli_env(deployment, tmp / "state")
    # a large local queue: these tests are about bulk jobs, not about the worker's partition pausing
    worker = start_worker(deployment, tmp, "bulk-w1")
    bulk = start_bulk_worker(deployment, tmp / "state", tmp / "bulk-worker.log")
    db = create_engine(deployment.database_url)
    yield deployment, env, db, tmp, bulk
    bulk.stop()
    assert worker.stop() == 0, worker.output()[-3000:]
    db.dispose()


def submit(env, path, *extra: str) -> str:
    return run_cli("bulk", "submit", str(path), *extra, env=env).stdout.strip()


def fetch(env, tmp, bulk_id: str) -> tuple[list[dict], list[dict]]:
    out, err = tmp / f"{bulk_id}.out.jsonl", tmp / f"{bulk_id}.err.jsonl"
    run_cli("bulk", "fetch", bulk_id, "-o", str(out), "--errors", str(err), env=env)
    return read_jsonl(out), read_jsonl(err)


def test_200_lines_come_back_in_input_order_with_invalid_lines_reported(dep):
    settings, env, db, tmp, _ = dep
    lines = [batch_line(f"row-{i:03d}", max_tokens=3) for i in range(200)]
    lines.insert(10, "{broken json")
    lines.insert(50, batch_line("row-bad", n=99))
    lines.insert(120, batch_line("row-000"))  # a duplicate custom_id
    path = write_batch(tmp / "in200.jsonl", lines)
    bulk_id = submit(env, path, "--skip-invalid", "--tenant", "bulk-tests")
    waited = run_cli("bulk", "wait", bulk_id, "--interval", "0.5", env=env)
    assert "200/200 100%" in waited.stderr

    out, errors = fetch(env, tmp, bulk_id)
    assert [o["custom_id"] for o in out] == [f"row-{i:03d}" for i in range(200)]
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 3 for o in out)
    assert [(e["error"]["line"], e["error"]["code"]) for e in errors] == [
        (11, "invalid_request"), (51, "invalid_request"), (121, "invalid_request"),
    ]  # fmt: skip
    assert "duplicate custom_id" in errors[2]["error"]["message"]

    status = json.loads(run_cli("bulk", "status", bulk_id, "--json", env=env).stdout)
    assert (status["status"], status["total_lines"], status["invalid_lines"]) == ("completed", 203, 3)
    assert (status["expected_jobs"], status["succeeded"], status["completion_tokens"]) == (200, 200, 600)
    with db.connect() as conn:
        rows = conn.execute(select(jobs.c.priority, jobs.c.tenant).where(jobs.c.bulk_id == bulk_id)).all()
    assert len(rows) == 200 and set(rows) == {("low", "bulk-tests")}
    folder = tmp / "state" / "bulk" / bulk_id  # the prompts and outputs: owner-only
    assert [stat.S_IMODE(p.stat().st_mode) for p in (folder, folder.parent)] == [0o700, 0o700]


def test_an_invalid_file_is_refused_with_line_numbers(dep):
    _, env, db, tmp, _ = dep
    path = write_batch(tmp / "bad.jsonl", [batch_line("ok"), batch_line("x", temperature=5), "[]"])
    done = run_cli("bulk", "submit", str(path), env=env, check=False)
    assert done.returncode == 1 and done.stdout == ""
    assert "line 2: temperature" in done.stderr and "line 3: a line must be a JSON object" in done.stderr
    assert "2 of 3 lines are invalid; nothing submitted" in done.stderr


def test_cancel_midway_stops_the_rest_and_still_writes_both_files(dep):
    settings, env, db, tmp, _ = dep
    path = numbered_batch(tmp / "slow.jsonl", 200, max_tokens=128)
    bulk_id = submit(env, path, "--tenant", "bulk-tests")
    wait_bulk(db, bulk_id, lambda r: r["status"] == "running")
    _wait_done(db, bulk_id, 3)  # a few done, most not
    run_cli("bulk", "cancel", bulk_id, env=env)
    waited = run_cli("bulk", "wait", bulk_id, "--interval", "0.5", env=env, check=False)
    assert waited.returncode == 1 and "cancelled" in waited.stderr

    out, errors = fetch(env, tmp, bulk_id)
    assert len(out) >= 3 and len(out) + len(errors) == 200
    ids = sorted([o["custom_id"] for o in out] + [e["custom_id"] for e in errors])
    assert ids == [f"req-{i:04d}" for i in range(200)]
    assert {e["error"]["code"] for e in errors} == {"cancelled"}
    assert bulk_row(db, bulk_id)["status"] == "cancelled"


def _wait_done(db, bulk_id: str, count: int) -> None:
    wait_bulk(db, bulk_id, lambda _: _succeeded(db, bulk_id) >= count)


def _succeeded(db, bulk_id: str) -> int:
    with db.connect() as conn:
        query = select(jobs.c.job_id).where(jobs.c.bulk_id == bulk_id, jobs.c.status == "succeeded")
        return len(conn.execute(query).all())


def test_killing_the_inference_worker_midway_loses_nothing(settings, tmp_path):
    deployment = make_deployment(settings)  # its own: this test kills its inference worker
    env = cli_env(deployment, tmp_path / "state")
    first = start_worker(deployment, tmp_path, "bulk-kill-1")
    bulk = start_bulk_worker(deployment, tmp_path / "state", tmp_path / "bulk-worker.log")
    db = create_engine(deployment.database_url)
    second = None
    try:
        bulk_id = submit(env, numbered_batch(tmp_path / "in.jsonl", 300, max_tokens=16))
        wait_bulk(db, bulk_id, lambda _: _succeeded(db, bulk_id) >= 20)
        first.stop(signal.SIGKILL)
        assert _succeeded(db, bulk_id) < 300  # killed mid-way
        second = start_worker(deployment, tmp_path, "bulk-kill-2")
        run_cli("bulk", "wait", bulk_id, "--interval", "2", env=env)
        out, errors = fetch(env, tmp_path, bulk_id)
    finally:
        bulk.stop()
        if second is not None:
            second.stop()
        db.dispose()
    assert [o["custom_id"] for o in out] == [f"req-{i:04d}" for i in range(300)] and errors == []
    assert {o["response"]["body"]["usage"]["completion_tokens"] for o in out} == {16}


# Last in the module: it kills the module's bulk worker.
def test_killing_the_bulk_worker_midway_loses_nothing(dep):
    settings, env, db, tmp, bulk = dep
    path = numbered_batch(tmp / "big.jsonl", 5000, max_tokens=1)
    bulk_id = submit(env, path)
    # SIGKILL once the producer has checkpointed at least once but not finished
    row = wait_bulk(
        db, bulk_id, lambda r: r["submitted_lines"] >= 200 or r["status"] != "submitting", poll_s=0.01
    )
    bulk.kill()
    assert row["status"] == "submitting" and 200 <= row["submitted_lines"] < 5000, row
    stalled = bulk_row(db, bulk_id)
    assert stalled["status"] == "submitting"

    restarted = start_bulk_worker(settings, tmp / "state", tmp / "bulk-worker-2.log")
    try:
        run_cli("bulk", "wait", bulk_id, "--interval", "2", env=env)
    finally:
        restarted.stop()
    out, errors = fetch(env, tmp, bulk_id)
    assert [o["custom_id"] for o in out] == [f"req-{i:04d}" for i in range(5000)] and errors == []
    with db.connect() as conn:  # one row per line: the re-sent part of the file made no new jobs
        job_ids = conn.execute(select(jobs.c.job_id).where(jobs.c.bulk_id == bulk_id)).scalars().all()
    assert len(job_ids) == len(set(job_ids)) == 5000
