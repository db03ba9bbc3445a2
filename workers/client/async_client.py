"""JobClient for an asyncio event loop: thousands of jobs waited for at once, no thread held while waiting.

A post or a cancel is handed to the producer on a small executor (a send can wait for a topic's metadata)
and its acknowledgement comes back as a future the broker's callback resolves; a followed job's records
come from the client's one stream hub (stream_hub.py) through a sink that wakes the loop. The order and
copies of token events are decided by the same `EventFeed` as `JobClient.stream`'s.

    client = AsyncJobClient(JobClient(settings), executor)
    sent = await client.submit(job, "normal")
    async with client.follow(sent.job_id, sent.tenant, tokens=True, results=True) as followed:
        item = await followed.get(timeout_s)   # a Record, CaughtUp, Failed, or None on timeout
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import Executor

from schemas.jobs import JobRequest, JobResult
from workers.client.job_client import DeliveryFailed, JobClient, Submitted
from workers.client.stream_hub import CaughtUp, Failed, Follower
from workers.kafka_io import Delivery, Placed, Record

Item = Record | CaughtUp | Failed


class AsyncJobClient:
    def __init__(self, client: JobClient, executor: Executor) -> None:
        """`executor`: where calls that may block on the broker's metadata run (a few threads suffice)."""
        self.client = client
        self.executor = executor
        self.topics = client.settings.topics

    async def submit(self, job: JobRequest, priority: str, timeout_s: float | None = None) -> Submitted:
        """Post the job and return once the broker has it; DeliveryFailed otherwise (the job may or may not
        be on the topic then: posting the same job_id again is safe)."""
        loop = asyncio.get_running_loop()
        delivery = await loop.run_in_executor(self.executor, self.client.post, job, priority)
        try:
            placed = await _settled(delivery, self.client.timeout_s if timeout_s is None else timeout_s)
        except Exception as exc:  # noqa: BLE001 - the broker's error, or no answer in time
            raise DeliveryFailed(job.job_id or "", exc) from exc
        return Submitted(
            job.job_id or "", job.tenant, priority, placed.topic, placed.partition, placed.offset
        )

    async def cancel(self, job_id: str, tenant: str, timeout_s: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        delivery = await loop.run_in_executor(self.executor, self.client.post_cancel, job_id, tenant)
        try:
            await _settled(delivery, self.client.timeout_s if timeout_s is None else timeout_s)
        except Exception as exc:  # noqa: BLE001
            raise DeliveryFailed(job_id, exc) from exc

    def follow(
        self, job_id: str, tenant: str, since_ms: int, *, tokens: bool = False, results: bool = True
    ) -> Followed:
        """The job's token events and/or result from `since_ms` on (use it as `async with`)."""
        topics = ((self.topics.tokens_for(tenant),) if tokens else ()) + (
            (self.topics.results_for(tenant),) if results else ()
        )
        return Followed(self, job_id, tenant, topics, since_ms)

    async def stored_result(
        self, job_id: str, tenant: str, executor: Executor | None = None
    ) -> JobResult | None:
        """The job's result from its row (JobClient.stored_result), off the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            executor or self.executor, self.client.stored_result, job_id, tenant
        )


class Followed:
    """One job's records, as an `async with` block: `get` the next, `rewind` (through an EventFeed)."""

    def __init__(
        self, owner: AsyncJobClient, job_id: str, tenant: str, topics: tuple[str, ...], since_ms: int
    ):
        self.owner, self.job_id, self.tenant, self.topics, self.since_ms = (
            owner,
            job_id,
            tenant,
            topics,
            since_ms,
        )
        self.results_topic = owner.topics.results_for(tenant)
        self.queue = _Inbox()
        self.follower: Follower | None = None

    async def __aenter__(self) -> Followed:
        loop = asyncio.get_running_loop()
        put = self.queue.put_nowait

        def sink(item: Item) -> None:  # on the hub's thread
            loop.call_soon_threadsafe(put, item)

        client = self.owner.client
        if client.follows_at_once(self.topics):  # no broker round trip: a hop to a thread would cost more
            self.follower = client.follow(self.job_id, self.topics, self.since_ms, sink)
        else:
            self.follower = await loop.run_in_executor(
                self.owner.executor, client.follow, self.job_id, self.topics, self.since_ms, sink
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop following (a command queued for the hub: never blocks); again: nothing."""
        if self.follower is not None:
            self.owner.client.unfollow(self.follower)
            self.follower = None

    async def get(self, timeout_s: float) -> Item | None:
        """The next item, or None after `timeout_s`."""
        return await self.queue.get(timeout_s)

    def is_result(self, item: Item) -> bool:
        return isinstance(item, Record) and item.topic == self.results_topic


class _Inbox:
    """A follow's items for one waiting reader: a deque and one future to wake it, with a timer for its
    timeout (asyncio.Queue under wait_for makes a task per wait: a third of a request's loop time went to
    such waits with thousands of requests waiting)."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: object) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self, timeout_s: float) -> object | None:
        if not self._items:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(max(0.0, timeout_s), _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        return self._items.popleft() if self._items else None


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _settled(delivery: Delivery, timeout_s: float) -> Placed:
    """The delivery's outcome, awaited without a thread: the producer's I/O thread calls back."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:  # on the producer's I/O thread
        def resolve() -> None:
            if done.done():
                return
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

        loop.call_soon_threadsafe(resolve)

    delivery.on_settled(settle)
    await asyncio.wait_for(done, timeout_s)
    return delivery.wait(0)  # settled: returns at once


def now_ms() -> int:
    return int(time.time() * 1000)
