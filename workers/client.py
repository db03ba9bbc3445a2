"""A small client for producer services: submit jobs, cancel them, stream their tokens, wait for results.

from workers.client import JobClient
from schemas.jobs import JobRequest

with JobClient() as client:
    job_id = client.submit(JobRequest(job_id="order-42", prompt="Hello"), priority="high")
    for event in client.stream(job_id):
        print(event.text, end="", flush=True)
    print(client.wait(job_id).status)
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

from schemas.jobs import JobRequest, JobResult, TokenEvent
from workers.kafka_io import Producer, TopicReader
from workers.settings import Settings


class JobTimeout(TimeoutError):
    pass


class JobClient:
    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self._producer = Producer(self.settings.kafka_connection, "inferq-client", linger_ms=5)
        self._submitted_ms: dict[str, int] = {}
        self._tenants: dict[str, str] = {}

    def __enter__(self) -> JobClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, job: JobRequest | dict, priority: str = "normal") -> str:
        """Post a job; returns its job_id (a fresh UUID when the job has none).

        Give your own job_id to make retries idempotent: a job_id already finished is never run again.
        """
        if isinstance(job, dict):
            job = JobRequest.model_validate(job)
        if job.job_id is None:
            job = job.model_copy(update={"job_id": uuid.uuid4().hex})
        topic = self.settings.topics.jobs(priority)
        data = job.model_dump(mode="json", exclude_none=True)
        self._submitted_ms[job.job_id] = int(time.time() * 1000) - 1000
        self._tenants[job.job_id] = job.tenant
        self._producer.send(topic, job.job_id, json.dumps(data).encode())
        return job.job_id

    def submit_raw(self, value: bytes, priority: str = "normal", key: str | None = None) -> None:
        """Post bytes as they are (for testing validation and the dead-letter path)."""
        self._producer.send(self.settings.topics.jobs(priority), key, value)

    def cancel(self, job_id: str, tenant: str | None = None) -> None:
        """Cancel a job of `tenant` (default: the tenant this client submitted it as, else "default")."""
        tenant = tenant or self._tenants.get(job_id, "default")
        value = json.dumps({"type": "cancel", "job_id": job_id, "tenant": tenant}).encode()
        self._producer.send(self.settings.topics.control, job_id, value)
        self._producer.flush()

    def flush(self) -> None:
        self._producer.flush()

    def stream(
        self, job_id: str, timeout_s: float | None = None, since_ms: int | None = None
    ) -> Iterator[TokenEvent]:
        """Token events of the job's latest attempt, until its final event.

        A new attempt (a worker died and another redid the job) restarts the text: an event with a
        higher attempt than seen so far begins again at seq 0, and the caller should reset its output.
        """
        self._producer.flush()
        since = since_ms if since_ms is not None else self._submitted_ms.get(job_id, 0)
        reader = TopicReader(
            self.settings.kafka_connection, self.settings.topics.tokens, since, "inferq-stream", key=job_id
        )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        seen: set[tuple[int, int]] = set()
        try:
            while deadline is None or time.monotonic() < deadline:
                for record in reader.poll(0.2):
                    event = TokenEvent.model_validate_json(record.value or b"{}")
                    if (event.attempt, event.seq) in seen:
                        continue  # the producer retried: de-duplicate by (attempt, seq)
                    seen.add((event.attempt, event.seq))
                    yield event
                    if event.finish_reason is not None:
                        return
            raise JobTimeout(f"no final token event for {job_id} within {timeout_s}s")
        finally:
            reader.close()

    def wait(
        self,
        job_id: str,
        timeout_s: float | None = None,
        since_ms: int | None = None,
        tenant: str | None = None,
    ) -> JobResult:
        """The job's result from the results topic (the result for `tenant`: default the submitting one).

        Another tenant posting the same job_id gets its own `rejected` result under the same key: it is
        skipped here.
        """
        tenant = tenant or self._tenants.get(job_id, "default")
        self._producer.flush()
        since = since_ms if since_ms is not None else self._submitted_ms.get(job_id, 0)
        reader = TopicReader(
            self.settings.kafka_connection, self.settings.topics.results, since, "inferq-wait", key=job_id
        )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while deadline is None or time.monotonic() < deadline:
                for record in reader.poll(0.2):
                    result = JobResult.model_validate_json(record.value or b"{}")
                    if result.tenant == tenant:
                        return result
            raise JobTimeout(f"no result for {job_id} within {timeout_s}s")
        finally:
            reader.close()

    def close(self) -> None:
        self._producer.flush()
        self._producer.close()
