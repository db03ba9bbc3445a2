"""Shared by the persistence and outbox tests: helpers that admit jobs and run a persister over write
items, as the worker does (their `env` fixture is in conftest.py)."""

from __future__ import annotations

from tests.workers.worker_factories import now_ms
from workers.kafka_io import KeyLookup, Record
from workers.serving.admission.admitter import Admitter
from workers.serving.intake.rejected import Rejected
from workers.serving.intake.validation import Accepted
from workers.serving.outbox.persister import Persister


def accepted(
    dep, job_id: str, tenant: str = "t-a", offset: int = 0, prompt: str = "hello", generation: int = 0
) -> Accepted:
    from schemas.jobs import JobRequest

    topic = dep.topics.jobs("normal")
    record = Record(topic, 0, offset, job_id.encode(), b"{}", now_ms(), generation=generation)
    job = JobRequest(job_id=job_id, tenant=tenant, prompt=prompt)
    return Accepted(record, job_id, "normal", job, prompt, (1, 2, 3), 8)


def admit_jobs(dep, db, worker_id: str, jobs: dict[str, int]) -> None:
    """Admit jobs (job_id -> source offset) as `worker_id` would: their rows are then queued."""
    admitter = Admitter(db, worker_id)
    admitter.add([accepted(dep, job_id, offset=offset) for job_id, offset in jobs.items()])
    admitter.run(lambda a: False)


def start_persister(dep, db, producer) -> Persister:
    def dead_letter(r: Rejected):
        return producer.send(
            dep.topics.dlq, r.record.key, r.record.value or b"", [("reason", r.reason.encode())]
        )

    published = KeyLookup(dep.kafka_connection, "inferq-test-lookup")
    p = Persister(db, producer, dep.topics, "w-test", dead_letter=dead_letter, published=published)
    p.start()
    return p


def run_items(persister: Persister, items) -> set:
    persister.submit(list(items))
    persister.close()
    return set(persister.acked())
