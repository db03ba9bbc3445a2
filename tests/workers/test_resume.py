"""Resume, don't restart, on the real services: a worker killed -9 mid-generation, or stopped, has its jobs
resumed by another from the tokens it saved, with the output an uninterrupted run gives and a stream that
never repeats or restarts text; progress another model saved is never resumed."""

from __future__ import annotations

import signal
import time

import pytest
from sqlalchemy import create_engine

from schemas.jobs import TokenEvent
from tests.workers.resume_factories import (
    Streams,
    as_client_reads,
    choice_texts,
    joined,
    on_one_partition,
    positions,
    reference,
    saved_tokens,
    stream_records,
    wait_saved,
)
from tests.workers.worker_factories import (
    job_rows,
    make_deployment,
    now_ms,
    results_by_job,
    start_worker,
    token_events,
    wait_group_members,
    wait_terminal,
    wait_until,
)
from workers.client import JobClient
from workers.serving.streaming.stream import MAX_EVENT_TOKENS

pytestmark = [pytest.mark.services, pytest.mark.slow]

SCHEMA = {  # long enough to be cut half-way: at least 20 strings of at least 8 characters
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string", "minLength": 8}, "minItems": 20}},
    "required": ["notes"],
}
MAX_TOKENS = 360
STOP_AT = 150  # the stop job's stop string starts at this token of its output
STOP_LEN = 40
NO_EOS = {"2": -100.0}  # the tiny model's EOS: free-text jobs run to max_tokens, past the kill
KINDS = {
    "greedy": {"prompt": "Resume greedy", "temperature": 0, "logit_bias": NO_EOS},
    "seeded": {"prompt": "Resume seeded", "temperature": 0.9, "top_p": 0.95, "seed": 1234,
               "logit_bias": NO_EOS},
    "unseeded": {"prompt": "Resume unseeded", "temperature": 1.0, "logit_bias": NO_EOS},
    "json": {"prompt": "Resume json", "temperature": 0.7, "seed": 9,
             "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
    "n2": {"prompt": "Resume two", "n": 2, "temperature": 0.8, "seed": 5, "logit_bias": NO_EOS},
    "logprobs": {"prompt": "Resume logprobs", "temperature": 0, "logprobs": True, "top_logprobs": 3,
                 "logit_bias": NO_EOS},
}  # fmt: skip


def with_stop_string(client: JobClient, jobs: dict[str, dict], tag: str) -> tuple[dict, int, str]:
    """The stop job: a seeded one whose stop string is 40 characters of its own output from about its 150th
    token on, found in a run of all the jobs together without it (as they run together later: a sampled
    job's tokens depend on its batch mates); with the token where that string starts and the text before."""
    params = {
        "prompt": "Resume stop",
        "temperature": 1.0,
        "seed": 77,
        "max_tokens": MAX_TOKENS,
        "logit_bias": NO_EOS,
    }
    ids = on_one_partition([f"pre-{kind}" for kind in [*jobs, "stop"]], tag)
    stream = Streams(client, [ids["pre-stop"]])
    time.sleep(1.0)  # the stream is placed before the job's first events
    batch = {**jobs, "stop": params}
    sent = client.submit_many([{**job, "job_id": ids[f"pre-{k}"]} for k, job in batch.items()], "high")
    lengths = {k: client.wait(s, 600).usage.completion_tokens for k, s in zip(batch, sent, strict=True)}
    # every job runs well past where the test kills its worker (the JSON one ends by its grammar)
    assert all(n > (STOP_AT + STOP_LEN + 20) * batch[k].get("n", 1) for k, n in lengths.items()), lengths
    stream.join()
    events = stream.events[ids["pre-stop"]]
    text = "".join(e.text for e in events)
    for e in events:  # where an event starts, its token and character positions are both known
        at = e.text_offset
        if e.offset >= STOP_AT and text.find(text[at : at + STOP_LEN]) == at and at + STOP_LEN < len(text):
            return {**params, "stop": [text[at : at + STOP_LEN]]}, e.offset, text[:at]
    raise AssertionError("no stop string of the uninterrupted run starts past its 150th token")


def test_a_worker_killed_mid_generation_is_resumed_with_the_uninterrupted_output(settings, tmp_path):
    dep = make_deployment(settings)
    client = JobClient(dep)
    db = create_engine(dep.database_url)
    workers = {w: start_worker(dep, tmp_path, w) for w in ("w-a", "w-b")}
    try:
        wait_group_members(dep, 2, timeout_s=300)  # two workers start at once on a shared machine
        jobs = {kind: {**params, "max_tokens": MAX_TOKENS} for kind, params in KINDS.items()}
        jobs["stop"], stop_token, before_stop = with_stop_string(client, jobs, dep.topic_prefix)

        # every job on one partition, posted together: the worker that owns it holds them all, in one batch
        ids = on_one_partition(jobs, dep.topic_prefix)
        since = now_ms()
        streams = Streams(client, ids.values())
        time.sleep(1.0)  # the streams are placed before the jobs' first events
        client.submit_many([{**job, "job_id": ids[kind]} for kind, job in jobs.items()], "high")
        saved = wait_saved(
            db, {ids[k]: 60 * jobs[k].get("n", 1) for k in jobs} | {ids["stop"]: stop_token + 5}
        )
        rows = job_rows(db, ids.values())
        (holder,) = {r["worker_id"] for r in rows.values()}
        assert all(r["status"] == "running" for r in rows.values()), rows
        workers[holder].stop(signal.SIGKILL)
        survivor = next(w for w in workers if w != holder)
        time.sleep(0.5)  # a commit on its way when the worker died has landed by now
        saved = saved_tokens(db, ids.values())
        # the stop job resumes inside its stop string: the string straddles the break
        assert stop_token < saved[ids["stop"]] < stop_token + STOP_LEN - 10, (stop_token, saved)
        rows = wait_terminal(db, list(ids.values()), timeout_s=600)
        streams.join()
        # the uninterrupted runs: the same jobs, posted together to one worker as they were (a sampled
        # job's numbers, and so its tokens, depend on its batch mates: gpu kernels per row count), the
        # unseeded one with the seed stored for it
        jobs["unseeded"]["seed"] = rows[ids["unseeded"]]["params"]["seed"]
        ref_ids = on_one_partition([f"ref-{kind}" for kind in jobs], dep.topic_prefix)
        sent = client.submit_many([{**job, "job_id": ref_ids[f"ref-{k}"]} for k, job in jobs.items()], "high")
        refs = {kind: client.wait(s, 600) for kind, s in zip(jobs, sent, strict=True)}
        results = results_by_job(dep, since, len(ids))
        events = token_events(stream_records(dep, since, ids.values()))
        log = workers[survivor].output()
        for kind, job_id in ids.items():
            row, ref = rows[job_id], refs[kind]
            assert (row["status"], row["attempts"], row["worker_id"]) == ("succeeded", 2, survivor), (
                kind,
                row,
            )
            assert f"job resumed {job_id} " in log, kind
            assert len(results[job_id]) == 1 and results[job_id][0].attempt == 2, kind
            result = results[job_id][0]
            assert choice_texts(result) == choice_texts(ref), kind  # the uninterrupted run's output
            assert result.usage.completion_tokens == ref.usage.completion_tokens, kind
            if kind == "logprobs":  # recomputed by the resuming prefill: the same tokens, the same numbers
                got, want = result.choices[0].logprobs.content, ref.choices[0].logprobs.content
                assert [e.token for e in got] == [e.token for e in want]
                assert max(abs(a.logprob - b.logprob) for a, b in zip(got, want, strict=True)) < 1e-3
            # JobClient.stream showed the output once, never restarted
            assert job_id not in streams.errors, (kind, streams.errors.get(job_id))
            shown = streams.events[job_id]
            assert not any(e.restarted for e in shown) and shown[-1].final, kind
            assert streams.texts(job_id) == choice_texts(ref), kind
            # so does the whole tokens topic read as the client reads it, and where both attempts sent a
            # position, they sent the same text
            mine = [e for e in events.get(job_id, []) if isinstance(e, TokenEvent)]
            assert joined(as_client_reads(mine)) == choice_texts(ref), kind
            assert {e.attempt for e in mine} == {1, 2}, kind
            for index in range(jobs[kind].get("n", 1)):
                first, second = positions(mine, 1, index), positions(mine, 2, index)
                assert first and all(second[i] == ch for i, ch in first.items() if i in second), (kind, index)
        assert refs["stop"].output_text == before_stop  # the stop job ends where its string begins
    finally:
        client.close()
        for w in workers.values():
            w.stop(signal.SIGKILL)
        db.dispose()


def test_sigterm_hands_32_running_jobs_over_within_the_bound_losing_at_most_a_save_interval(
    settings, tmp_path
):
    dep = make_deployment(settings)
    client = JobClient(dep)
    db = create_engine(dep.database_url)
    # the default drain timeout (5 s); saves far apart, so that only the stop's own save makes it lose nothing
    extra = ("--drain-timeout", "5", "--save-interval-ms", "3000")
    workers = {w: start_worker(dep, tmp_path, w, *extra) for w in ("w-a", "w-b")}
    try:
        wait_group_members(dep, 2, timeout_s=300)  # two workers start at once on a shared machine
        ids = on_one_partition([f"drain{i}" for i in range(32)], dep.topic_prefix)
        since = now_ms()
        for i, job_id in enumerate(ids.values()):
            job = {
                "job_id": job_id,
                "prompt": f"Drain {i}",
                "max_tokens": 1500,
                "temperature": 0.8,
                "seed": i,
                "logit_bias": NO_EOS,
            }
            client.submit(job, "normal")
        wait_saved(db, dict.fromkeys(ids.values(), 20))
        time.sleep(1.0)  # tokens generated since that save
        rows = job_rows(db, ids.values())
        (holder,) = {r["worker_id"] for r in rows.values()}
        assert all(r["status"] == "running" for r in rows.values())
        # exits 0 within 10 s, or is killed (and the code says so)
        assert workers[holder].stop(signal.SIGTERM, timeout_s=10) == 0, workers[holder].output()[-3000:]
        survivor = next(w for w in workers if w != holder)
        assert "handed 32 running jobs over to the group" in workers[holder].output()
        rows = wait_terminal(db, list(ids.values()), timeout_s=900)
        events = token_events(stream_records(dep, since, ids.values()))
        for job_id in ids.values():
            row = rows[job_id]
            assert (row["status"], row["attempts"], row["worker_id"]) == ("succeeded", 2, survivor), row
            assert row["completion_tokens"] == 1500
            mine = events[job_id]
            first = [e for e in mine if e.attempt == 1]
            streamed = max(e.offset + len(e.token_ids) for e in first)
            restated = 0  # attempt 2's restatement: from offset 0, in parts of MAX_EVENT_TOKENS but its last
            for e in sorted((e for e in mine if e.attempt == 2), key=lambda e: e.seq):
                assert e.offset == restated, (job_id, e.seq, e.offset, restated)
                restated += len(e.token_ids)
                if len(e.token_ids) < MAX_EVENT_TOKENS:
                    break
            # a graceful stop saves all it generated: nothing is lost (the bar allows a save interval's)
            assert restated >= streamed, (job_id, restated, streamed)
            shown = as_client_reads(mine)  # each token once, never restarted
            assert joined(shown)[0] == row["output_text"]
            assert sum(len(e.token_ids) for e in shown) == row["completion_tokens"]
    finally:
        client.close()
        for w in workers.values():
            w.stop(signal.SIGKILL)
        db.dispose()


def test_progress_of_another_model_is_never_resumed(settings, tmp_path):
    """Progress saved with another fingerprint (a worker of another model): the job starts from scratch,
    says why, and ends with this model's output."""
    from datetime import UTC, datetime

    from schemas.job_key import JobKey
    from workers.db.jobs import Admission, admit
    from workers.db.progress import ProgressChunk, save_progress

    dep = make_deployment(settings)
    client = JobClient(dep)
    db = create_engine(dep.database_url)
    worker = start_worker(dep, tmp_path, "w-only")
    try:
        wait_group_members(dep, 1, timeout_s=300)
        job = {"prompt": "Another model", "max_tokens": 80, "temperature": 0.9, "seed": 3}
        ref = reference(client, {**job, "job_id": f"ref-other-{dep.topic_prefix}"})
        job_id = f"other-{dep.topic_prefix}"
        now = datetime.now(UTC)
        with db.begin() as conn:  # attempt 1 ran on a worker of another model, saved 5 tokens, and died
            admission = Admission(job_id, "default", "normal", "Another model", {**job, "seed": 3}, None, now,
                                  now, "w-gone", (dep.topics.jobs("normal"), 0, 0))  # fmt: skip
            assert admit(conn, [admission])[JobKey("default", job_id)].attempt == 1
            chunk = ProgressChunk(job_id, "default", 0, 1, 0, (300, 301, 302, 303, 304), "!#$%&", "0" * 32)
            assert save_progress(conn, [chunk], now) == 1
        sent = client.submit({**job, "job_id": job_id}, "normal")
        result = client.wait(sent, 300)
        assert (result.status, result.attempt, result.output_text) == ("succeeded", 2, ref.output_text)
        wait_until(lambda: f"job restarted {job_id} " in worker.output())
        assert "reason=model_changed" in worker.output()
        assert saved_tokens(db, [job_id]) == {}  # its terminal row took the unusable progress with it
    finally:
        client.close()
        worker.stop(signal.SIGTERM)
        db.dispose()
