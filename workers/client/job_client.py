"""The client for producer services: submit jobs (each confirmed by the broker), cancel them, stream their
tokens and wait for their results, with a timeout on every call. A light import: no torch, no Celery.

from workers.client import JobClient

with JobClient() as client:
    sent = client.submit({"job_id": "order-42", "prompt": "Hello"}, priority="high")
    print(sent.partition, sent.offset)          # where the broker stored it
    for event in client.stream(sent):
        print(event.text, end="", flush=True)
    print(client.wait(sent).status)

One consumer serves all the jobs a client follows (workers/client/stream_hub.py), however many streams
and waits run at once, from any number of threads. With `database_url`, `wait` falls back to the job's
row in PostgreSQL when the results topic no longer has its result (retention, or a result published
before the wait began).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from schemas.jobs import JobRequest, JobResult, TokenEvent
from workers.client.event_feed import EventFeed
from workers.client.stream_hub import CaughtUp, Failed, Follower, StreamHub
from workers.kafka_io import Delivery, PartitionReader, Producer, Record
from workers.settings import Settings

log = logging.getLogger(__name__)

DELIVERY_TIMEOUT_S = 30.0  # connecting, metadata, and the broker's acknowledgement of a message
WAIT_TIMEOUT_S = 300.0  # stream() and wait(): how long a job may take to produce its final event
# The stream hub's fetches: a job followed while an empty fetch is in flight (kafka-python sends one per
# broker at a time; the default holds it 500 ms) is read only once that fetch returns; a fetch this short
# bounds that wait (while nothing is followed no fetch is sent; while jobs are, 40 empty fetches a second)
_FETCH_WAIT_S = 0.025


class JobTimeout(TimeoutError):
    pass


@dataclass(frozen=True)
class Submitted:
    """A job the broker has acknowledged (acks=all): its id and where it was stored."""

    job_id: str
    tenant: str
    priority: str
    topic: str
    partition: int
    offset: int


class DeliveryFailed(RuntimeError):
    """The broker did not acknowledge a job in time. `delivered`: the jobs of the same call it did take
    (sending the whole batch again is safe: job_ids make it idempotent)."""

    def __init__(self, job_id: str, error: BaseException, delivered: tuple[Submitted, ...] = ()) -> None:
        super().__init__(f"job {job_id} was not delivered: {type(error).__name__}: {error}")
        self.job_id = job_id
        self.delivered = delivered


JobRef = str | Submitted


def _job_id(job: JobRef) -> str:
    return job.job_id if isinstance(job, Submitted) else job


class JobClient:
    def __init__(
        self,
        settings: Settings | None = None,
        *,
        timeout_s: float = DELIVERY_TIMEOUT_S,
        database_url: str | None = None,
    ) -> None:
        """`timeout_s` bounds every exchange with the broker; `database_url` enables the result fallback."""
        self.settings = settings or Settings.from_env()
        self.timeout_s = timeout_s
        self.database_url = database_url
        conn = self.settings.kafka_connection
        # linger 0: a confirmed submit waits one round trip, not a batching delay as well
        self._producer = Producer(
            conn, "inferq-client", linger_ms=0, max_block_s=timeout_s, timeout_s=timeout_s
        )
        self._submitted_ms: dict[str, int] = {}
        self._tenants: dict[str, str] = {}
        self._hub: StreamHub | None = None
        self._hub_lock = threading.Lock()
        self._db = None

    def __enter__(self) -> JobClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- producing -----------------------------------------------------------------------------
    def submit(
        self, job: JobRequest | dict, priority: str = "normal", *, timeout_s: float | None = None
    ) -> Submitted:
        """Post a job and wait until the broker has it; raises DeliveryFailed otherwise.

        Give your own job_id to make retries idempotent: a job_id already finished is never run again.
        """
        return self.submit_many([job], priority, timeout_s=timeout_s)[0]

    def submit_many(
        self,
        jobs: Iterable[JobRequest | dict],
        priority: str = "normal",
        *,
        timeout_s: float | None = None,
        on_delivered: Callable[[Submitted], None] | None = None,
    ) -> list[Submitted]:
        """Post jobs together (one round of batching), then confirm each; all are validated before any is
        sent. Raises DeliveryFailed at the first job the broker did not take within `timeout_s`."""
        prepared = [self._prepare(job) for job in jobs]
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        sent = [(job, self.post(job, priority)) for job in prepared]
        done: list[Submitted] = []
        for job, delivery in sent:
            try:
                placed = delivery.wait(max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - KafkaTimeoutError, broker errors
                raise DeliveryFailed(job.job_id, exc, tuple(done)) from exc
            done.append(
                Submitted(job.job_id, job.tenant, priority, placed.topic, placed.partition, placed.offset)
            )
            if on_delivered is not None:
                on_delivered(done[-1])
        return done

    def post(self, job: JobRequest, priority: str = "normal") -> Delivery:
        """Hand a job (with its job_id) to the producer without waiting for the broker: the caller waits on
        the delivery (`submit`), or is called back (`Delivery.on_settled`: the HTTP API's event loop).
        Raises DeliveryFailed when it cannot even be sent (no metadata in time, the buffer full)."""
        assert job.job_id is not None
        try:
            data = json.dumps(job.model_dump(mode="json", exclude_none=True)).encode()
            topic = self.settings.topics.jobs_for(job.tenant, priority)  # per-tenant topics: the tenant's own
            return self._producer.send(topic, job.job_id, data)
        except Exception as exc:  # noqa: BLE001 - no metadata in time, buffer full: not delivered
            raise DeliveryFailed(job.job_id, exc) from exc

    def _prepare(self, job: JobRequest | dict) -> JobRequest:
        if isinstance(job, dict):
            job = JobRequest.model_validate(job)
        if job.job_id is None:
            job = job.model_copy(update={"job_id": uuid.uuid4().hex})
        self._submitted_ms[job.job_id] = int(time.time() * 1000) - 1000
        self._tenants[job.job_id] = job.tenant
        return job

    def submit_raw(self, value: bytes, priority: str = "normal", key: str | None = None) -> None:
        """Post bytes as they are (for testing validation and the dead-letter path); see `flush`."""
        self._producer.send(self.settings.topics.jobs(priority), key, value)

    def cancel(self, job: JobRef, tenant: str | None = None, *, timeout_s: float | None = None) -> None:
        """Cancel a job of `tenant` (default: the tenant this client submitted it as, else "default");
        returns once the broker has the cancel (raises DeliveryFailed otherwise)."""
        job_id = _job_id(job)
        tenant = tenant or self._tenants.get(job_id, "default")
        try:
            self.post_cancel(job_id, tenant).wait(self.timeout_s if timeout_s is None else timeout_s)
        except DeliveryFailed:
            raise
        except Exception as exc:  # noqa: BLE001
            raise DeliveryFailed(job_id, exc) from exc

    def post_cancel(self, job_id: str, tenant: str) -> Delivery:
        """`cancel` without waiting for the broker (see `post`)."""
        value = json.dumps({"type": "cancel", "job_id": job_id, "tenant": tenant}).encode()
        try:
            return self._producer.send(self.settings.topics.control_for(tenant), job_id, value)
        except Exception as exc:  # noqa: BLE001
            raise DeliveryFailed(job_id, exc) from exc

    def flush(self, timeout_s: float | None = None) -> None:
        """Out with anything `submit_raw` left buffered (submit and cancel never leave anything)."""
        self._producer.flush(self.timeout_s if timeout_s is None else timeout_s)

    # ---- following -----------------------------------------------------------------------------
    def stream(
        self,
        job: JobRef,
        timeout_s: float | None = WAIT_TIMEOUT_S,
        since_ms: int | None = None,
        tenant: str | None = None,
    ) -> Iterator[TokenEvent]:
        """Token events of the job until its final one; raises JobTimeout after `timeout_s`.

        Each sample's text is yielded once, in order, and never restarted: joined, the events' texts are
        the job's output. An attempt's events come in seq order (see TokenOrder): a copy of one already
        seen (same attempt and seq) is skipped, and one that comes before an earlier seq waits for it. A
        new attempt (a worker died or let the job go, and another resumed it) continues the output: what
        it sends again for positions already yielded is cut off (see ContinuousOutput), and the earlier
        attempts' late events are skipped. Only an attempt that could not resume starts the output over:
        its first event yielded has `restarted` set, and the caller drops what it had of the job.
        """
        job_id = _job_id(job)
        tenant = tenant or self._tenants.get(job_id, "default")
        follower = self._follow(job_id, (self.settings.topics.tokens_for(tenant),), since_ms)
        deadline = time.monotonic() + (WAIT_TIMEOUT_S if timeout_s is None else timeout_s)
        feed = EventFeed(job_id, follower)
        try:
            while (left := deadline - time.monotonic()) > 0:
                item = follower.get(min(left, 1.0))
                if item is None:
                    continue
                for event in feed.take(item):
                    yield event
                    if event.final:  # with n > 1, samples' finish_reason come before: not the end yet
                        return
            raise JobTimeout(f"no final token event for {job_id} within {timeout_s}s")
        finally:
            self._unfollow(follower)

    def wait(
        self,
        job: JobRef,
        timeout_s: float | None = WAIT_TIMEOUT_S,
        since_ms: int | None = None,
        tenant: str | None = None,
    ) -> JobResult:
        """The job's result for `tenant` (default: the submitting one); raises JobTimeout after `timeout_s`.

        Another tenant's job of the same job_id has its own result under the same key (on the shared
        results topic): it is skipped here. With `database_url`, a result the topic no longer holds is read
        from the job's row.
        """
        job_id = _job_id(job)
        tenant = tenant or self._tenants.get(job_id, "default")
        follower = self._follow(job_id, (self.settings.topics.results_for(tenant),), since_ms)
        deadline = time.monotonic() + (WAIT_TIMEOUT_S if timeout_s is None else timeout_s)
        try:
            while (left := deadline - time.monotonic()) > 0:
                item = follower.get(min(left, 1.0))
                if isinstance(item, Failed):
                    raise item.error
                if isinstance(item, CaughtUp):
                    stored = self.stored_result(job_id, tenant)
                    if stored is not None:
                        return stored
                elif item is not None:
                    result = JobResult.model_validate_json(item.value or b"{}")
                    if result.tenant == tenant:
                        return result
            stored = self.stored_result(job_id, tenant)
            if stored is not None:
                return stored
            raise JobTimeout(f"no result for {job_id} within {timeout_s}s")
        finally:
            self._unfollow(follower)

    def forget(self, job: JobRef) -> None:
        """Drop what the client keeps about a submitted job (its submit time and tenant): a long-lived
        process (the HTTP API) calls it once it no longer follows the job."""
        job_id = _job_id(job)
        self._submitted_ms.pop(job_id, None)
        self._tenants.pop(job_id, None)

    def follow(
        self,
        job_id: str,
        topics: tuple[str, ...],
        since_ms: int,
        sink: Callable[[Record | CaughtUp | Failed], None],
    ) -> Follower:
        """The job's records of these topics from `since_ms` on, handed to `sink` on the hub's thread (see
        StreamHub.follow); `unfollow` it when done. May wait for a topic's partition count (metadata)."""
        return self._follow(job_id, topics, since_ms, sink)

    def unfollow(self, follower: Follower) -> None:
        self._unfollow(follower)

    def follows_at_once(self, topics: tuple[str, ...]) -> bool:
        """Whether `follow` of these topics returns without waiting for the broker (its hub runs and knows
        their partition counts)."""
        hub = self._hub
        return hub is not None and hub.alive and all(hub.knows(t) for t in topics)

    def _follow(
        self,
        job_id: str,
        topics: tuple[str, ...],
        since_ms: int | None,
        sink: Callable[[Record | CaughtUp | Failed], None] | None = None,
    ) -> Follower:
        since = since_ms if since_ms is not None else self._submitted_ms.get(job_id, 0)
        with self._hub_lock:
            if self._hub is None or not self._hub.alive:

                def reader() -> PartitionReader:
                    return PartitionReader(
                        self.settings.kafka_connection, "inferq-client-watch", self.timeout_s, _FETCH_WAIT_S
                    )

                self._hub = StreamHub(reader, {})
            for topic in topics:
                if not self._hub.knows(topic):
                    self._hub.learn(topic, self._producer.partitions(topic))
            return self._hub.follow(job_id, topics, since, sink)

    def _unfollow(self, follower: Follower) -> None:
        if self._hub is not None:
            self._hub.unfollow(follower)

    def stored_result(self, job_id: str, tenant: str) -> JobResult | None:
        """The result built from the job's row (as workers build what they publish), once it is terminal
        and published; None without a database URL, a row of this tenant, or a published result."""
        if self.database_url is None:
            return None
        from workers.db.connect import make_engine
        from workers.db.job_queries import job_row
        from workers.db.outbox import result_from_row

        if self._db is None:
            self._db = make_engine(self.database_url)
        with self._db.connect() as conn:
            row = job_row(conn, job_id, tenant)
        if row is None or row.published_at is None:
            return None
        return result_from_row(row)

    def close(self) -> None:
        if self._hub is not None:
            self._hub.close()
        self._producer.flush(self.timeout_s)
        self._producer.close(self.timeout_s)
        if self._db is not None:
            self._db.dispose()
