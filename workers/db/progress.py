"""Running jobs' progress: each sample's generated tokens, saved in chunks as the job runs, read back by the
job's next attempt to resume from (the `job_progress` table, migration 0011).

A chunk is one save of one sample by one attempt: the tokens generated since its previous save, at
`position` in the sample's output. Saves only insert (a save costs its new tokens, never a rewrite of what
was saved before), set-based like the persister's other writes: one statement for every chunk of a flush.
A save is fenced by attempt: it is stored only while the job's row is that attempt's and not terminal, so a
worker that lost the job (its partition moved, its membership lapsed) never adds to a later attempt's
progress. A save that was already running when a later attempt was admitted may still land after that
admission read the progress; the chain below keeps such a chunk out of what is resumed.

A sample's chain: the latest attempt's chunks from where it began (its lowest position) on, then, below
that, the chain of the attempts before it; cut at the first gap and after a chunk that ended the sample.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, text

from schemas.job_key import JobKey
from schemas.tables import TERMINAL_STATUSES
from workers.db.sets import KEYS, arrays, key_arrays, unnest


@dataclass(frozen=True, slots=True)
class ProgressChunk:
    """Tokens one attempt generated for one sample since its previous save."""

    job_id: str
    tenant: str
    sample: int
    attempt: int
    position: int  # where token_ids start in the sample's output
    token_ids: tuple[int, ...]
    text: str  # what these tokens added to the sample's text
    fingerprint: str  # the model and tokenizer that generated them
    finish_reason: str | None = None  # the sample ended with these tokens (its job goes on)

    @property
    def key(self) -> JobKey:
        return JobKey(self.tenant, self.job_id)


@dataclass(frozen=True)
class SavedSample:
    """One sample's saved output, as its chain of chunks has it."""

    token_ids: tuple[int, ...]
    text: str
    fingerprints: frozenset[str]  # of the chunks in the chain (one, unless the model changed)
    finish_reason: str | None = None  # the sample had ended


@dataclass(frozen=True)
class SavedProgress:
    """A job's saved progress: each sample's chain (samples that saved nothing are absent)."""

    samples: dict[int, SavedSample]
    latest_attempt: int  # the last attempt that saved any

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples.values())

    def fingerprints(self) -> frozenset[str]:
        return frozenset().union(*(s.fingerprints for s in self.samples.values()))


_CHUNK_FIELDS = (
    ("job_id", "text[]"), ("tenant", "text[]"), ("sample", "integer[]"), ("attempt", "integer[]"),
    ("position", "integer[]"), ("token_ids", "text[]"), ("text", "text[]"), ("fingerprint", "text[]"),
    ("finish_reason", "text[]"),
)  # fmt: skip
_TERMINAL_SQL = ", ".join(f"'{s}'" for s in TERMINAL_STATUSES)
# token_ids travel as one text element each ('{1,2,3}'), cast per row: unnest flattens a 2-D array
_SAVE = text(
    f"""INSERT INTO job_progress
  (job_id, tenant, sample, attempt, position, token_ids, text, fingerprint, finish_reason, saved_at)
SELECT v.job_id, v.tenant, v.sample, v.attempt, v.position, CAST(v.token_ids AS integer[]), v.text,
  v.fingerprint, v.finish_reason, :now
FROM {unnest(_CHUNK_FIELDS)} JOIN jobs ON jobs.job_id = v.job_id AND jobs.tenant = v.tenant
WHERE jobs.attempts = v.attempt AND jobs.status NOT IN ({_TERMINAL_SQL})
ON CONFLICT DO NOTHING"""
)


def save_progress(conn: Connection, chunks: Sequence[ProgressChunk], now: datetime) -> int:
    """Store chunks (one statement) whose job is still at their attempt and not terminal; how many were
    stored (a chunk stored before, by a retried batch, counts as not stored now)."""
    if not chunks:
        return 0
    rows = [
        (c.job_id, c.tenant, c.sample, c.attempt, c.position, _int_array(c.token_ids), c.text,
         c.fingerprint, c.finish_reason)
        for c in chunks
    ]  # fmt: skip
    return conn.execute(_SAVE, {**arrays(_CHUNK_FIELDS, rows), "now": now}).rowcount


def _int_array(ids: Sequence[int]) -> str:
    return "{" + ",".join(map(str, ids)) + "}"


_READ = text(
    f"""SELECT p.job_id, p.tenant, p.sample, p.attempt, p.position, p.token_ids, p.text, p.fingerprint,
  p.finish_reason
FROM job_progress p JOIN {KEYS} ON p.tenant = k.tenant AND p.job_id = k.job_id"""
)


def saved_progress(conn: Connection, keys: Sequence[JobKey]) -> dict[JobKey, SavedProgress]:
    """The saved progress of these jobs (one statement), by key; jobs with none are absent."""
    if not keys:
        return {}
    chunks: dict[JobKey, list[ProgressChunk]] = {}
    for r in conn.execute(_READ, key_arrays(keys)):
        chunk = ProgressChunk(
            r.job_id, r.tenant, r.sample, r.attempt, r.position, tuple(r.token_ids), r.text, r.fingerprint,
            r.finish_reason,
        )  # fmt: skip
        chunks.setdefault(chunk.key, []).append(chunk)
    out = {}
    for key, found in chunks.items():
        samples = {}
        for sample in sorted({c.sample for c in found}):
            saved = chain([c for c in found if c.sample == sample])
            if saved.token_ids:
                samples[sample] = saved
        if samples:
            out[key] = SavedProgress(samples, max(c.attempt for c in found))
    return out


def chain(chunks: Iterable[ProgressChunk]) -> SavedSample:
    """One sample's chunks as one output: the latest attempt's from its lowest position, below that the
    attempts before it (each below where the next one began), contiguous from position 0."""
    by_attempt: dict[int, list[ProgressChunk]] = {}
    for c in chunks:
        by_attempt.setdefault(c.attempt, []).append(c)
    kept: list[ProgressChunk] = []
    limit: int | None = None  # where a later attempt began: earlier attempts count only below it
    for attempt in sorted(by_attempt, reverse=True):
        below = [c for c in by_attempt[attempt] if limit is None or c.position < limit]
        if below:
            kept += below
            limit = min(c.position for c in below)
    ids: list[int] = []
    texts: list[str] = []
    fingerprints: set[str] = set()
    finish = None
    for c in sorted(kept, key=lambda c: c.position):
        if c.position != len(ids):
            break  # a gap (a save that never landed): what follows it cannot be used
        ids += c.token_ids
        texts.append(c.text)
        fingerprints.add(c.fingerprint)
        if c.finish_reason is not None:
            finish = c.finish_reason
            break
    return SavedSample(tuple(ids), "".join(texts), frozenset(fingerprints), finish)


_DROP = text(f"DELETE FROM job_progress p USING {KEYS} WHERE p.tenant = k.tenant AND p.job_id = k.job_id")


def drop_progress(conn: Connection, keys: Sequence[JobKey]) -> None:
    """Forget these jobs' saved progress (their terminal rows are written)."""
    if keys:
        conn.execute(_DROP, key_arrays(keys))
