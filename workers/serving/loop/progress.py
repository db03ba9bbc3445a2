"""Progress that survives the worker: each running job's new tokens, handed to the persister in one set-based
write every save interval, so a job's next owner resumes from them (workers/db/progress.py).

The bound: a token reaches PostgreSQL at the first save pass after it was generated (passes run every
`interval_s`) once its job has run for one interval; a job's first interval is never saved (a short job
costs no write at all). A worker killed at any moment loses, per job, the tokens of at most its last
interval (two, in a job's first ones) plus what the persister had not committed yet; a graceful stop, a
rebalance or a lost membership saves every job's tokens before the job is let go.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from schemas.jobs import JobRequest
from workers.db.progress import ProgressChunk

SAVE_INTERVAL_S = 0.25  # default: at about 20 tokens a second a job, 5 tokens a save


@dataclass(slots=True)
class SampleProgress:
    """One sample's tokens since its last save."""

    position: int = 0  # tokens before `pending`: saved, or resumed from a save
    pending: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # the text those tokens added
    finish_reason: str | None = None  # how the sample ended (its job may go on)
    finish_saved: bool = False


class JobProgress:
    """A running job's output per sample, and how much of it PostgreSQL has."""

    __slots__ = ("samples", "saved")

    def __init__(self, n: int) -> None:
        self.samples = [SampleProgress() for _ in range(n)]
        self.saved = False  # rows of it exist (saved here, or found from an earlier attempt)

    def add(self, index: int, token_ids: Sequence[int], text: str) -> None:
        sample = self.samples[index]
        sample.pending.extend(token_ids)
        if text:
            sample.pieces.append(text)

    def resume(self, index: int, tokens: int) -> None:
        """Sample `index` continues from `tokens` saved tokens (what it generates next is new)."""
        sample = self.samples[index]
        sample.position, sample.pending, sample.pieces = tokens, [], []

    def end(self, index: int, reason: str) -> None:
        self.samples[index].finish_reason = reason

    @property
    def unsaved(self) -> bool:
        return any(s.pending or (s.finish_reason and not s.finish_saved) for s in self.samples)

    def take(self, job_id: str, tenant: str, attempt: int, fingerprint: str) -> list[ProgressChunk]:
        """The chunks of every sample's tokens since its last save (handed to the persister)."""
        chunks = []
        for index, s in enumerate(self.samples):
            ended = s.finish_reason is not None and not s.finish_saved
            if not s.pending and not (ended and s.position):
                continue
            chunks.append(
                ProgressChunk(
                    job_id,
                    tenant,
                    index,
                    attempt,
                    s.position,
                    tuple(s.pending),
                    "".join(s.pieces),
                    fingerprint,
                    s.finish_reason,
                )  # fmt: skip
            )
            s.position += len(s.pending)
            s.pending, s.pieces = [], []
            s.finish_saved = s.finish_reason is not None
        if chunks:
            self.saved = True
        return chunks


class ProgressSaver:
    """When to save, and what: a pass every `interval_s` over the running jobs."""

    def __init__(self, fingerprint: str, interval_s: float = SAVE_INTERVAL_S) -> None:
        self.fingerprint = fingerprint
        self.interval_s = interval_s
        self._next = 0.0

    def due(self, now: float) -> bool:
        return self.interval_s > 0 and now >= self._next

    def collect(self, jobs: Iterable[SavedJob], now: float, force: bool = False) -> list[ProgressChunk]:
        """Chunks of the jobs with unsaved tokens that have run one interval at least (all, with `force`)."""
        if not force:
            self._next = now + self.interval_s
        young = now - self.interval_s
        chunks: list[ProgressChunk] = []
        for job in jobs:
            progress, first = job.progress, job.first_token_mono
            if not progress.unsaved or (not force and (first is None or first > young)):
                continue
            chunks += progress.take(job.job_id, job.request.tenant, job.attempt, self.fingerprint)
        return chunks


class SavedJob(Protocol):
    """What the saver reads of a job (workers/serving/loop/inflight.py's InFlightJob)."""

    job_id: str
    attempt: int
    request: JobRequest
    first_token_mono: float | None
    progress: JobProgress
