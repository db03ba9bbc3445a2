"""Admission: accepted records become `queued` rows (or are recognised as redeliveries) before they run.

Admission writes synchronously, since what the table says decides what happens next (run it as attempt N,
republish a finished job's result, honour an earlier cancel); job ids are per tenant. It never stops
the worker: while PostgreSQL is away the records wait here, intake is paused, and tries are spaced by
jittered backoff; a row PostgreSQL refuses for its data is split off and rejected on its own.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime

from workers.clock import utcnow
from workers.db import Engine
from workers.db.jobs import Admission, Admitted, admit
from workers.db.progress import saved_progress
from workers.kafka_io import Partition
from workers.serving.admission.models import ServedModels
from workers.serving.errors import Backoff, describe_error, is_transient
from workers.serving.intake.rejected import Rejected
from workers.serving.intake.validation import Accepted, rejection

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    accepted: Accepted
    outcome: Admitted


class Admitter:
    def __init__(self, db: Engine, worker_id: str, models: ServedModels | None = None) -> None:
        self._db = db
        self._worker_id = worker_id
        self._models = models or ServedModels()  # what a job's `model` may name (the base, adapters)
        self._pending: list[Accepted] = []
        self._backoff = Backoff(base_s=0.2, cap_s=10.0)
        self._retry_at = 0.0
        # seeds of jobs posted without one: unpredictable, not secret (a system call per job would show)
        self._seeds = random.Random(secrets.randbits(128))

    @property
    def blocked(self) -> bool:
        """Records are waiting for the database: intake should pause."""
        return bool(self._pending) and time.monotonic() < self._retry_at

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, accepted: Iterable[Accepted]) -> None:
        self._pending.extend(accepted)

    def drop(self, partitions: set[Partition]) -> None:
        """Forget pending records of revoked partitions: their new owner reads them again."""
        self._pending = [a for a in self._pending if a.record.source not in partitions]

    def run(self, is_held: Callable[[Accepted], bool]) -> tuple[list[Decision], list[Rejected]]:
        """Admit what is pending if the backoff allows; what to start or settle, and what to reject.

        `is_held(a)`: this worker already runs that job for that tenant (a duplicate message): it is
        settled without a write, which would re-queue the running row.
        """
        if not self._pending or time.monotonic() < self._retry_at:
            return [], []
        held = [Decision(a, Admitted("held")) for a in self._pending if is_held(a)]
        batch, self._pending = _first_of_each_id([a for a in self._pending if not is_held(a)])
        if not batch:
            return held, []
        try:  # each job's model, before its row: a model refused to it gets a `rejected` row instead
            batch, refused = self._models.resolve(self._db, batch)
        except Exception as exc:  # noqa: BLE001 - only a transient failure leaves resolve()
            self._later(batch, exc)
            return held, []
        try:
            decisions, rejected = (self._admit(batch) if batch else []), []
        except Exception as exc:  # noqa: BLE001
            if is_transient(exc):
                self._later(batch, exc)
                return held, refused
            log.warning(
                "admitting %d jobs failed (%s); admitting them one by one", len(batch), describe_error(exc)
            )
            decisions, rejected = self._one_by_one(batch)
        if time.monotonic() >= self._retry_at:  # no transient failure part way
            self._backoff.reset()
        return held + decisions, refused + rejected

    def _admit(self, batch: list[Accepted]) -> list[Decision]:
        now = utcnow()
        rows = [self._row(a, now) for a in batch]
        with self._db.begin() as conn:
            outcomes = admit(conn, rows)
            # a re-queued job's saved progress, read after its row is this attempt's: a save of the
            # attempt before that lands later is fenced out (or, if it was running already, left out of
            # the chain the next attempt resumes from: workers/db/progress.py)
            again = [key for key, o in outcomes.items() if o.kind == "start" and o.attempt > 1]
            for key, saved in saved_progress(conn, again).items():
                outcomes[key] = replace(outcomes[key], progress=saved)
        return [Decision(a, outcomes[(a.tenant, a.job_id)]) for a in batch]

    def _one_by_one(self, batch: list[Accepted]) -> tuple[list[Decision], list[Rejected]]:
        decisions: list[Decision] = []
        rejected: list[Rejected] = []
        for i, a in enumerate(batch):
            try:
                decisions += self._admit([a])
            except Exception as exc:  # noqa: BLE001
                if is_transient(exc):
                    self._later(batch[i:], exc)
                    break
                error = f"job could not be stored: {describe_error(exc)}"
                rejected.append(rejection(a.record, a.priority, error, "unstorable", a.job_id, a.tenant))
        return decisions, rejected

    def _later(self, batch: list[Accepted], exc: Exception) -> None:
        self._pending = batch + self._pending
        delay = self._backoff.next_delay()
        self._retry_at = time.monotonic() + delay
        waiting = len(self._pending)
        log.warning(
            "admission waits for the database (%s): %d jobs, next try in %.1fs",
            describe_error(exc),
            waiting,
            delay,
        )

    def _row(self, a: Accepted, now: datetime) -> Admission:
        return Admission(
            job_id=a.job_id,
            tenant=a.tenant,
            priority=a.priority,
            prompt=a.prompt_text,
            params=self._params(a),
            bulk_id=a.job.bulk_id,
            created_at=a.record.posted_at(now),
            queued_at=now,
            worker_id=self._worker_id,
            source=a.record.coordinates,
            generation=a.record.generation,
            model=a.model or self._models.base.name,  # an adapter's name, or the base's
        )

    def _params(self, a: Accepted) -> dict:
        """The row's params: the request as received, with the seed it samples with (drawn here when
        the job gave none; the row keeps the first admission's, so every attempt samples alike)."""
        params = a.job.model_dump(mode="json", exclude={"prompt", "messages", "job_id"})
        if params.get("seed") is None:
            params["seed"] = self._seeds.getrandbits(63)
        return params


def _first_of_each_id(pending: list[Accepted]) -> tuple[list[Accepted], list[Accepted]]:
    """One record per job (tenant, job_id) goes to the table now (one statement cannot upsert a row
    twice); later copies wait a round, when the first one's outcome (held, done) settles them."""
    first: dict[str, Accepted] = {}
    later: list[Accepted] = []
    for a in pending:
        if a.key in first:
            later.append(a)
        else:
            first[a.key] = a
    return list(first.values()), later
