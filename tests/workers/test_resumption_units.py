"""Saving running jobs' progress (what a save pass takes, and when) and planning a later attempt's resume."""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.jobs import JobRequest
from workers.db.progress import SavedProgress, SavedSample
from workers.serving.loop import resumption
from workers.serving.loop.progress import JobProgress, ProgressSaver

FP = "a" * 32


@dataclass
class Job:
    job_id: str
    first_token_mono: float | None
    attempt: int = 1
    request: JobRequest = field(default_factory=lambda: JobRequest(prompt="p", tenant="t"))
    progress: JobProgress = field(default_factory=lambda: JobProgress(2))


def test_a_pass_takes_each_samples_new_tokens_once_from_where_the_last_save_ended():
    job = Job("j", first_token_mono=0.0)
    job.progress.add(0, (1, 2), "ab")
    job.progress.add(1, (7,), "x")
    saver = ProgressSaver(FP, interval_s=0.25)
    first = saver.collect([job], now=1.0)
    assert [(c.sample, c.position, c.token_ids, c.text, c.attempt) for c in first] == [
        (0, 0, (1, 2), "ab", 1),
        (1, 0, (7,), "x", 1),
    ]
    assert saver.collect([job], now=2.0) == []  # nothing new
    job.progress.add(0, (3,), "")  # a token whose text is held back
    job.progress.add(0, (4,), "cd")
    job.progress.end(1, "stop")  # sample 1 ended (the job goes on): its end is saved once
    again = saver.collect([job], now=3.0)
    assert [(c.sample, c.position, c.token_ids, c.text, c.finish_reason) for c in again] == [
        (0, 2, (3, 4), "cd", None),
        (1, 1, (), "", "stop"),
    ]
    assert saver.collect([job], now=4.0) == [] and job.progress.saved


def test_a_job_in_its_first_interval_is_saved_only_when_it_is_let_go():
    young = Job("young", first_token_mono=0.9)
    waiting = Job("waiting", first_token_mono=None)
    young.progress.add(0, (1,), "a")
    saver = ProgressSaver(FP, interval_s=0.25)
    assert saver.due(1.0) and saver.collect([young, waiting], now=1.0) == []
    assert not saver.due(1.1)  # the next pass is one interval later
    assert [c.job_id for c in saver.collect([young, waiting], now=1.1, force=True)] == ["young"]


def test_a_resumed_sample_saves_on_from_where_it_resumed():
    job = Job("j", first_token_mono=0.0, attempt=3)
    job.progress.resume(0, 40)
    job.progress.add(0, (41,), "z")
    (c,) = ProgressSaver(FP).collect([job], now=10.0)
    assert (c.position, c.token_ids, c.attempt) == (40, (41,), 3)


def saved(fingerprints: tuple[str, ...] = (FP,), samples: dict[int, tuple[int, ...]] | None = None):
    samples = samples or {0: (1, 2, 3)}
    return SavedProgress(
        {i: SavedSample(ids, "x", frozenset(fingerprints)) for i, ids in samples.items()}, latest_attempt=1
    )


def test_a_later_attempt_resumes_only_progress_of_this_model_and_seed():
    assert resumption.plan(1, None, 1, FP, sampled=True, seed=3) == resumption.ResumePlan()
    assert resumption.plan(2, None, 1, FP, sampled=False, seed=None).restart == resumption.NO_PROGRESS
    other = resumption.plan(2, saved(("b" * 32,)), 1, FP, sampled=False, seed=None)
    assert (other.restart, other.saved, other.tokens) == (resumption.MODEL_CHANGED, 3, ())
    mixed = resumption.plan(2, saved((FP, "b" * 32)), 1, FP, sampled=False, seed=None)
    assert mixed.restart == resumption.MODEL_CHANGED
    assert resumption.plan(2, saved(), 1, FP, sampled=True, seed=None).restart == resumption.NO_SEED
    ok = resumption.plan(2, saved(samples={1: (5, 6)}), 3, FP, sampled=True, seed=3)
    assert ok.restart is None and ok.tokens == ((), (5, 6), ()) and ok.resumes
