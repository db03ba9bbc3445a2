"""Waiting for a job on the event loop: its records as they come, the two bounds on the wait (time queued,
then time generating), and the signals that end a wait early (the client left).

A request follows its job through the client's one stream hub (AsyncJobClient.follow): its token events (a
stream), its result, and the sentinels put in the same queue by the request's own watchers: STARTED when the
job is seen running, DISCONNECTED when the client is gone. A stream sees its job start with its first event;
a request that is not streamed has no events before its result, so `Starts` looks at the rows of every such
request of this process with one query a second and tells those that started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.api.context import APIContext
from workers.client.async_client import Followed
from workers.db import job_queries

log = logging.getLogger(__name__)

STARTED = "started"  # sentinels in a Followed queue (records, CaughtUp and Failed are the hub's)
DISCONNECTED = "disconnected"
STARTS_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Bounds:
    """How long a request waits: for its job to start, then for it to finish; and, when the client said
    how long it waits itself (the SDK's `x-stainless-read-timeout`), the moment to answer before it gives
    up."""

    queue_s: float
    generation_s: float
    client_deadline: float | None = None  # time.monotonic() of the last useful moment to answer


class Timeout(Exception):
    def __init__(self, phase: str, waited_s: float) -> None:
        super().__init__(phase)
        self.phase, self.waited_s = phase, waited_s  # phase: queued (never started) or running


class Watch:
    """One request's view of its job: the next item within the bound of the phase it is in."""

    def __init__(self, followed: Followed, bounds: Bounds) -> None:
        self.followed = followed
        self.bounds = bounds
        self.began = time.monotonic()
        self.phase = "queued"
        self._deadline = self.began + bounds.queue_s

    def started(self) -> None:
        if self.phase == "queued":
            self.phase = "running"
            self._deadline = time.monotonic() + self.bounds.generation_s

    def left_s(self) -> float:
        deadline = self._deadline
        if self.bounds.client_deadline is not None:
            deadline = min(deadline, self.bounds.client_deadline)
        return deadline - time.monotonic()

    async def next(self, at_most_s: float | None = None) -> Any:
        """The next record (or CaughtUp, Failed, DISCONNECTED); None when `at_most_s` passed first (a
        heartbeat is due); raises Timeout when the phase's bound passed. STARTED is taken here."""
        while True:
            left = self.left_s()
            if left <= 0:
                raise Timeout(self.phase, time.monotonic() - self.began)
            wait = left if at_most_s is None else min(left, at_most_s)
            item = await self.followed.get(wait)
            if item is STARTED:
                self.started()
                continue
            if item is None and (at_most_s is None or wait < at_most_s):
                continue  # the bound: raised above
            return item


class Starts:
    """Tells waiting requests that their job started (its row left `queued`): one query a second for all."""

    def __init__(self, ctx: APIContext, interval_s: float = STARTS_INTERVAL_S) -> None:
        self.ctx = ctx
        self.interval_s = interval_s
        self._watched: dict[tuple[str, str], list[Callable[[], None]]] = {}
        self._task: asyncio.Task | None = None

    def watch(self, tenant: str, job_id: str, signal: Callable[[], None]) -> Callable[[], None]:
        """Call `signal` once the job started (or ended); returns the call that stops watching."""
        self._watched.setdefault((tenant, job_id), []).append(signal)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="inferq-api-starts")

        def unwatch() -> None:
            signals = self._watched.get((tenant, job_id))
            if signals is not None and signal in signals:
                signals.remove(signal)
                if not signals:
                    del self._watched[(tenant, job_id)]

        return unwatch

    async def _run(self) -> None:
        while self._watched:
            await asyncio.sleep(self.interval_s)
            keys = list(self._watched)
            try:
                started = await self.ctx.run_db(self._started, keys)
            except Exception as exc:  # noqa: BLE001 - the database away: the bounds still hold, ask again
                log.warning("could not read the status of %d jobs: %s", len(keys), exc)
                continue
            for key in started:
                for signal in self._watched.pop(key, ()):
                    signal()

    def _started(self, keys: list[tuple[str, str]]) -> set[tuple[str, str]]:
        with self.ctx.db.connect() as conn:
            return job_queries.started(conn, keys)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


async def watch_disconnect(receive: Callable[[], Any], followed: Followed) -> None:
    """Put DISCONNECTED in the request's queue when its client leaves (the body has been read: what the
    server delivers now is the disconnect). Cancelled once the answer is sent."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            followed.queue.put_nowait(DISCONNECTED)
            return
