"""Saved progress on the real PostgreSQL: saves are fenced by attempt, a job's next admission reads the chain
of what its attempts saved (and the seed stored with it), its terminal row deletes it, and SQL sees it.
`env` is in conftest.py."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import text

from schemas.job_key import JobKey
from tests.workers.worker_factories import job_rows
from workers.db.jobs import Admission, Terminal, admit
from workers.db.progress import ProgressChunk, chain, save_progress, saved_progress
from workers.serving.outbox.writes import Concluded, Progress, Running, WriteContext, apply_all

pytestmark = pytest.mark.services

TENANT = "t-progress"
FP = "f" * 32


def admission(dep, job_id: str, params: dict | None = None, worker: str = "w-a") -> Admission:
    now = datetime.now(UTC)
    return Admission(
        job_id=job_id,
        tenant=TENANT,
        priority="normal",
        prompt="p",
        params={"max_tokens": 64, "seed": None, **(params or {})},
        bulk_id=None,
        created_at=now,
        queued_at=now,
        worker_id=worker,
        source=(dep.topics.jobs("normal"), 0, 0),
    )


def chunk(job_id, attempt, position, ids, text_="", sample=0, fp=FP, finish=None) -> ProgressChunk:
    return ProgressChunk(job_id, TENANT, sample, attempt, position, tuple(ids), text_, fp, finish)


def new_id() -> str:
    return f"progress-{uuid.uuid4().hex[:10]}"


def test_saves_are_fenced_by_attempt_and_the_next_admission_reads_their_chain(env):
    dep, db, _ = env
    job = new_id()
    key = JobKey(TENANT, job)
    with db.begin() as conn:
        assert admit(conn, [admission(dep, job, {"seed": 7})])[key].seed == 7
        now = datetime.now(UTC)
        assert save_progress(conn, [chunk(job, 1, 0, [1, 2], "ab"), chunk(job, 1, 2, [3], "c")], now) == 2
        assert save_progress(conn, [chunk(job, 1, 2, [3], "c")], now) == 0  # a retried batch: no copy
        second = admit(conn, [admission(dep, job, {"seed": 99}, worker="w-b")])[key]
        # a save of attempt 1 after attempt 2 was admitted is refused (the fence)
        assert save_progress(conn, [chunk(job, 1, 3, [4], "d")], now) == 0
    assert (second.kind, second.attempt, second.seed) == ("start", 2, 7)  # the first admission's seed
    with db.begin() as conn:
        saved = saved_progress(conn, [key])[key]
    assert saved.samples[0].token_ids == (1, 2, 3) and saved.samples[0].text == "abc"
    assert saved.latest_attempt == 1 and saved.fingerprints() == {FP}
    with db.begin() as conn:  # attempt 2 resumed at 3; a save of attempt 1 that was running lands late
        save_progress(conn, [chunk(job, 2, 3, [40, 50], "XY")], datetime.now(UTC))
        conn.execute(
            text("INSERT INTO job_progress VALUES (:j, :t, 0, 1, 3, '{4,5,6}', 'def', :f, NULL, now())"),
            {"j": job, "t": TENANT, "f": FP},
        )
        saved = saved_progress(conn, [key])[key]
        summary = conn.execute(
            text("SELECT tokens, text, attempt FROM job_progress_summary WHERE job_id = :j"), {"j": job}
        ).one()
    assert saved.samples[0].token_ids == (1, 2, 3, 40, 50) and saved.samples[0].text == "abcXY"
    assert tuple(summary) == (5, "abcXY", 2)  # SQL sees the same chain


def test_the_chain_uses_each_attempt_below_where_the_next_began_and_stops_at_a_gap_or_an_end():
    def c(attempt, position, ids, finish=None):
        return chunk("j", attempt, position, ids, "".join(chr(65 + i % 26) for i in ids), finish=finish)

    # attempt 3 restarted from scratch (another model): only its own chunks count
    assert chain([c(1, 0, [1, 2]), c(1, 2, [3]), c(3, 0, [9])]).token_ids == (9,)
    # attempt 2 resumed at 2 and saved a chunk whose predecessor never landed
    assert chain([c(1, 0, [1, 2]), c(2, 4, [5])]).token_ids == (1, 2)
    # attempt 2 resumed at 2; attempt 1's late chunks from 2 on (stale) are left out
    assert chain([c(1, 0, [1, 2]), c(1, 2, [7, 7]), c(2, 2, [3])]).token_ids == (1, 2, 3)
    assert chain([c(1, 0, [1, 2]), c(2, 2, [3]), c(1, 3, [7])]).token_ids == (1, 2, 3)
    ended = chain([c(1, 0, [1, 2], finish="stop"), c(1, 2, [3])])
    assert (ended.token_ids, ended.finish_reason) == ((1, 2), "stop")


def test_a_terminal_row_deletes_its_jobs_progress_in_the_same_batch(env):
    dep, db, _ = env
    ended, running = new_id(), new_id()
    keys = [JobKey(TENANT, ended), JobKey(TENANT, running)]
    with db.begin() as conn:
        admit(conn, [admission(dep, ended), admission(dep, running)])
    now = datetime.now(UTC)
    ctx = WriteContext("w-a", now)
    items = [
        Running(ended, now, 1, tenant=TENANT),
        Progress((chunk(ended, 1, 0, [1], "a"), chunk(running, 1, 0, [5, 6], "xy", sample=1))),
        Concluded(
            Terminal(ended, "succeeded", {"output_text": "a", "finished_at": now}, 1, TENANT),
            (),
            progress=True,
        ),  # fmt: skip
    ]
    with db.begin() as conn:
        apply_all(conn, items, ctx)
        saved = saved_progress(conn, keys)
    assert set(saved) == {JobKey(TENANT, running)}
    assert saved[JobKey(TENANT, running)].samples[1].token_ids == (5, 6)
    assert job_rows(db, [ended])[ended]["status"] == "succeeded"


def test_a_seed_is_stored_once_for_a_row_admitted_before_seeds_were(env):
    dep, db, _ = env
    job = new_id()
    key = JobKey(TENANT, job)
    with db.begin() as conn:
        legacy = admission(dep, job)  # params without a seed, as earlier workers wrote them
        assert admit(conn, [legacy])[key].seed is None
        assert admit(conn, [admission(dep, job, {"seed": 5})])[key].seed == 5
        assert admit(conn, [admission(dep, job, {"seed": 6})])[key].seed == 5
    assert job_rows(db, [job])[job]["params"]["seed"] == 5
