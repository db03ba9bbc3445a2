"""A chat or completion request as a job on the queue: checked, posted with the key's tenant (or reattached
to the job a first try of it posted), then waited for (one JSON answer) or streamed (Server-Sent Events).

Everything waits on the event loop: the job's result and token events come from the client's one stream
hub (AsyncJobClient), database calls run on the context's pool, and no request holds a thread. A request
follows its job's result even when it streams, so a job that ends without running (rejected at intake,
cancelled before it started) ends its stream at once with the reason. Its first second is held back before
the response starts: a rejection that comes in that time is answered with its status (400), as the same
request unstreamed is.

The body is checked and turned into a job by the bulk path's rules (check_body, checked_job), and the answer
is built by the bulk path's `response_body`, so a request answers exactly as the same body does as a
Batch line. Each endpoint (serving_chat, serving_completion) adds only its stream chunks' shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from schemas.jobs import JobRequest, JobResult, TokenEvent
from schemas.statuses import TERMINAL_STATUSES
from workers.api import retries
from workers.api.bodies import job_of_body, needs_grammar
from workers.api.context import APIContext
from workers.api.errors import APIError, not_found
from workers.api.fleet import Fleet
from workers.api.job_watch import DISCONNECTED, STARTED, Bounds, Starts, Timeout, Watch, watch_disconnect
from workers.api.limits import Slot
from workers.api.models import job_model
from workers.api.protocol import LiveOptions, split_live_options, usage
from workers.api.request_body import json_body
from workers.api.retries import RequestKey
from workers.api.sse import EventStreamResponse
from workers.bulk.batch_format import BatchLine
from workers.bulk.output import response_body
from workers.client import DeliveryFailed
from workers.client.async_client import Followed, now_ms
from workers.client.event_feed import EventFeed
from workers.client.stream_hub import CaughtUp, Failed
from workers.db.job_queries import job_row
from workers.db.outbox import result_from_row

log = logging.getLogger(__name__)

STREAM_HOLD_S = 1.0  # a stream's answer waits this long for its first event (a rejection: a plain 400)
RESULT_GRACE_S = 3.0  # a stream whose result came waits this long for its last token event, then ends
CLIENT_GONE = 499  # nginx's "client closed request": what the metrics count for a request whose client left
# A stream's last event ending its job with one of these (refused by the engine, failed, past its deadline)
# is no answer: the stream ends with the job's error instead, its reason read from the job's result.
FAILED_FINISHES = ("rejected", "error", "expired")


def result_row(result: JobResult) -> dict[str, Any]:
    """A finished job's result as the jobs row the bulk path's answer builders read."""
    used = result.usage
    return {
        "job_id": result.job_id,
        "status": result.status,
        "output_text": result.output_text,
        "finish_reason": result.finish_reason,
        "choices": [c.model_dump(mode="json") for c in result.choices] or None,
        "prompt_tokens": used.prompt_tokens if used else 0,
        "completion_tokens": used.completion_tokens if used else 0,
        "cached_tokens": used.cached_tokens if used else None,
        "finished_at": result.timings.finished_at,
        "created_at": result.timings.created_at,
        "error": result.error,
    }


class _Request:
    """One request's state from its body on: what it asked, its job, how it may be retried."""

    def __init__(self, request: Request, tenant: str, line: BatchLine, job: JobRequest, live: LiveOptions,
                 key: RequestKey, arrived: float) -> None:  # fmt: skip
        self.request, self.tenant, self.line, self.job, self.live = request, tenant, line, job, live
        self.key, self.arrived = key, arrived
        self.since_ms = now_ms() - 1000  # records of the job are looked for from here on
        self.reattached = False  # a retry of a request whose job was posted before

    @property
    def job_id(self) -> str:
        return self.job.job_id or ""

    @property
    def created(self) -> int:
        return int(self.arrived)


class ServingEngine:
    url: str  # the endpoint, as a Batch line names it
    id_prefix: str  # of the job ids (and so of the response ids)
    kind: str  # the `object` of a stream chunk

    def __init__(self, ctx: APIContext, fleet: Fleet, starts: Starts) -> None:
        self.ctx, self.fleet, self.starts = ctx, fleet, starts
        self.settings = ctx.settings
        self._background: set[asyncio.Task] = set()  # cancels in flight (kept referenced until done)

    # ---- the endpoint's own shapes ---------------------------------------------------------------------
    def chunk_choice(self, event: TokenEvent, first: bool) -> dict[str, Any]:
        raise NotImplementedError

    def text_choice(self, index: int, text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
        """A chunk's choice carrying `text` (a stream completed from the job's result)."""
        event = TokenEvent(job_id="", attempt=0, seq=0, text=text, token_ids=[], index=index,
                           finish_reason=finish_reason)  # fmt: skip
        return self.chunk_choice(event, first)

    # ---- a request -------------------------------------------------------------------------------------
    async def create(self, request: Request, tenant: str) -> Response:
        slot = self.ctx.limits.hold(tenant)  # the tenant's requests in flight here (off by default): 429
        handed = False
        try:
            response = await self._create(request, tenant, slot)
            handed = isinstance(response, EventStreamResponse)  # it gives the place back when it ends
            return response
        finally:
            if not handed:
                slot.release()

    async def _create(self, request: Request, tenant: str, slot: Slot) -> Response:
        arrived = time.time()
        body, live = split_live_options(await json_body(request, self.settings.api_max_body_bytes))
        model = await self.fleet.check(body.get("model"), tenant)
        key = retries.request_key(request, self.url, body, live.model_dump())
        line, job = await self.to_job(body, tenant, model)
        req = _Request(request, tenant, line, job, live, key, arrived)
        attached = await retries.attach(self.ctx, tenant, key, job.job_id or "")
        if attached is not None:
            req.job = job.model_copy(update={"job_id": attached.job_id})
            req.since_ms = int(attached.created_at.timestamp() * 1000) - 1000
        request.state.job_id = req.job_id
        if live.stream:  # only a streamed answer reads token events (a Batch line's job has none)
            req.job = req.job.model_copy(update={"stream": True})
        if attached is not None and attached.job_id != job.job_id:
            req.reattached = True
            log.info("job %s: a retry of its request reattaches to it", req.job_id)
            row = await self._row(req.job_id, tenant)
            if row is not None and row.status in TERMINAL_STATUSES:
                log.info("job %s: a retry of its request is answered from its row", req.job_id)
                return self._replay(req, result_from_row(row), slot)
            if row is not None:  # posted, and a worker has it: wait for it, post nothing
                return await self._follow(req, slot, post=False)
        return await self._follow(req, slot, post=True)

    async def _follow(self, req: _Request, slot: Slot, post: bool) -> Response:
        followed = self.ctx.jobs.follow(req.job_id, req.tenant, req.since_ms, tokens=req.live.stream)
        await followed.__aenter__()
        started = time.perf_counter()
        try:
            if post:
                await self._submit(req)
            if req.live.stream:
                return await self._start_stream(req, followed, slot)  # the stream owns `followed` now
            result = await self._wait(req, followed)
        except BaseException:
            followed.close()
            raise
        followed.close()
        if result is None:  # the client left
            return Response(status_code=CLIENT_GONE)
        # Server-Timing: the time spent in the queue (posting and waiting); the rest of a request's latency
        # is the API's own (bench/api/overhead.py)
        queue_ms = (time.perf_counter() - started) * 1000
        headers = {"X-Job-Id": req.job_id, "Server-Timing": f"queue;dur={queue_ms:.3f}"}
        return JSONResponse(self.answer(req.line, result, req.created), headers=headers)

    async def retrieve(self, job_id: str, tenant: str) -> JSONResponse:
        """The answer to an earlier request of this tenant, by its id (= its job id), built from its jobs row:
        any API process finds it, also after the one that took the request died or timed out (504)."""
        row = await self._row(job_id, tenant) if job_id.startswith(f"{self.id_prefix}-") else None
        if row is None:
            raise not_found("completion", job_id)
        if row.status not in TERMINAL_STATUSES:
            raise APIError(
                409, f"Job {job_id} is {row.status}: it has no answer yet.", code="job_not_finished",
                job_id=job_id, status=row.status,
            )  # fmt: skip
        model = row.model or self.fleet.default(await self.fleet.names())  # an adapter's name, or the base's
        line = BatchLine(1, job_id, self.url, model, {})
        result = result_from_row(row)
        created = int(row.created_at.timestamp()) if row.created_at else 0
        return JSONResponse(self.answer(line, result, created), headers={"X-Job-Id": job_id})

    async def to_job(self, body: dict[str, Any], tenant: str, model: str) -> tuple[BatchLine, JobRequest]:
        """The job of a body, checked by the Batch path's rules (fields refused by name, the job's limits,
        the output constraint): a body means here what it means as a Batch line. A body with an output
        constraint is checked off the loop (compiling a schema can take a while). The job's `model`: None for
        the base (the workers' names for it may differ from the API's), the adapter's name otherwise."""
        job_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        if needs_grammar(body):
            line, job = await asyncio.to_thread(job_of_body, self.url, body, tenant, model, job_id)
        else:
            line, job = job_of_body(self.url, body, tenant, model, job_id)
        return line, job.model_copy(update={"model": job_model(job.model, await self.fleet.base_names())})

    async def _row(self, job_id: str, tenant: str) -> Any:
        def look_up() -> Any:
            with self.ctx.db.connect() as conn:
                return job_row(conn, job_id, tenant)

        return await self.ctx.run_db(look_up)

    async def _submit(self, req: _Request) -> None:
        try:
            await self.ctx.jobs.submit(req.job, req.live.priority)
        except DeliveryFailed as exc:
            await retries.remember(self.ctx, req.tenant, req.key, req.job_id)  # the broker may have it
            raise APIError(
                503, f"The queue did not take the request: {exc}", code="queue_unavailable"
            ) from None

    def answer(self, line: BatchLine, result: JobResult, created: int) -> dict[str, Any]:
        if result.status == "succeeded":
            return {**response_body(line, result_row(result)), "created": created}
        raise job_error(result)

    # ---- waiting for a result --------------------------------------------------------------------------
    def _bounds(self, req: _Request, *, streamed: bool) -> Bounds:
        # a stream's client reads as long as bytes come (heartbeats): only the two bounds apply to it
        deadline = None if streamed else retries.client_deadline(req.request)
        return Bounds(self.settings.api_queue_timeout_s, self.settings.api_generation_timeout_s, deadline)

    async def _wait(self, req: _Request, followed: Followed) -> JobResult | None:
        """The job's result; None when the client left first (its job is cancelled, per the deployment)."""
        watch = Watch(followed, self._bounds(req, streamed=False))
        unwatch = self.starts.watch(req.tenant, req.job_id, lambda: followed.queue.put_nowait(STARTED))
        listener = asyncio.ensure_future(watch_disconnect(req.request.receive, followed))
        try:
            while True:
                item = await watch.next()
                if item is DISCONNECTED:
                    await self._client_left(req)
                    return None
                if isinstance(item, Failed):
                    raise APIError(
                        503, f"The queue could not be read: {item.error}", code="queue_unavailable"
                    )
                if isinstance(item, CaughtUp):
                    if req.reattached and item.placement == 0:  # its result may be out before we looked
                        stored = await self.ctx.jobs.stored_result(req.job_id, req.tenant, self.ctx.db_pool)
                        if stored is not None:
                            return stored
                    continue
                result = JobResult.model_validate_json(item.value or b"{}")
                if result.tenant == req.tenant:
                    return result
        except Timeout as timeout:
            stored = await self.ctx.jobs.stored_result(req.job_id, req.tenant, self.ctx.db_pool)
            if stored is not None:
                return stored
            await retries.remember(self.ctx, req.tenant, req.key, req.job_id)
            raise timed_out(req.job_id, timeout) from None
        finally:
            listener.cancel()
            unwatch()

    async def _client_left(self, req: _Request) -> None:
        """The client is gone before its answer: cancel its job, unless the deployment keeps such jobs or the
        request carried an Idempotency-Key (its client said it will come back for the answer)."""
        if self.settings.api_cancel_on_disconnect and req.key.idempotency_key is None:
            log.info("the client of job %s left before its answer: cancelling it", req.job_id)
            self._cancel_soon(req)
        else:
            log.info("the client of job %s left before its answer; the job goes on", req.job_id)
            await retries.remember(self.ctx, req.tenant, req.key, req.job_id)

    def _cancel_soon(self, req: _Request) -> None:
        """A cancel that outlives the request's task (which may be being cancelled itself)."""

        async def cancel() -> None:
            try:
                await self.ctx.jobs.cancel(req.job_id, req.tenant)
                log.info("cancel of %s sent", req.job_id)
            except DeliveryFailed as exc:
                log.warning("cancel of %s not delivered: %s", req.job_id, exc)

        self._later(cancel())

    def _later(self, work: Any) -> None:
        """Run a coroutine on its own task, kept referenced until it is done."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- streaming -------------------------------------------------------------------------------------
    async def _start_stream(self, req: _Request, followed: Followed, slot: Slot) -> Response:
        """Hold the answer back until the job's first event (or STREAM_HOLD_S): a job refused in that time
        is answered with its error status, as it would be unstreamed; otherwise the stream starts."""
        early: deque[Any] = deque()
        hold_until = time.monotonic() + STREAM_HOLD_S
        while (left := hold_until - time.monotonic()) > 0:
            item = await followed.get(left)
            if item is None:
                break
            early.append(item)
            if followed.is_result(item):
                result = JobResult.model_validate_json(item.value or b"{}")
                if result.tenant == req.tenant and result.status != "succeeded":
                    raise job_error(result)  # (no token event came before it: the loop ends at the first)
                break
            if isinstance(item, CaughtUp) or _failed_at_once(item, followed):
                continue  # a refusal's last event (no text): its result, with the reason, follows
            break  # a token event (or the hub's failure): the stream tells it
        stream = _Stream(self, req, followed, slot)
        return EventStreamResponse(self._sse(stream, early), {"X-Job-Id": req.job_id}, stream.close)

    def _replay(self, req: _Request, result: JobResult, slot: Slot) -> Response:
        """A retry of a request whose job ended: its answer (a stream of it, for a streamed request)."""
        if not req.live.stream:
            return JSONResponse(self.answer(req.line, result, req.created), headers={"X-Job-Id": req.job_id})
        if result.status != "succeeded":
            raise job_error(result)

        async def events() -> AsyncIterator[str]:
            for text in self._from_result(req, result, {}):
                yield text
            yield "data: [DONE]\n\n"

        return EventStreamResponse(events(), {"X-Job-Id": req.job_id}, slot.release)

    def _chunk(self, req: _Request, **fields: Any) -> str:
        chunk = {
            "id": req.job_id,
            "object": self.kind,
            "created": req.created,
            "model": req.line.model,
            **fields,
        }
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def _from_result(self, req: _Request, result: JobResult, texts: dict[int, str]) -> list[str]:
        """The chunks that complete a stream from the job's result: each choice's text past what was sent
        (`texts`), its finish reason, then the usage if asked."""
        choices = result.choices or [_choice0(result)]
        chunks = []
        for choice in choices:
            sent = texts.get(choice.index, "")
            if not choice.text.startswith(sent):
                return [_error_event(APIError(500, "The stream and the job's result differ", code="stream"))]
            rest = self.text_choice(choice.index, choice.text[len(sent):], choice.finish_reason,
                                    choice.index not in texts)  # fmt: skip
            chunks.append(self._chunk(req, choices=[rest]))
        if req.live.include_usage and result.usage is not None:
            used = usage(
                result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.cached_tokens
            )
            chunks.append(self._chunk(req, choices=[], usage=used))
        return chunks

    async def _sse(self, stream: _Stream, early: deque[Any]) -> AsyncIterator[str]:
        """The job's token events as chunks, then `data: [DONE]`; heartbeats while nothing comes; the job's
        failure as an error event. A stream that ends before its job's end cancels the job (_Stream.close):
        its client left, or its bound passed."""
        req, followed = stream.req, stream.followed
        watch = Watch(followed, self._bounds(req, streamed=True))
        feed = EventFeed(req.job_id, followed.follower)  # type: ignore[arg-type]
        texts: dict[int, str] = {}
        result: JobResult | None = None
        result_by = 0.0
        finished = False
        failing = False  # an event ended the job as failed: its result (the reason) ends the stream
        try:
            while not finished:
                if early:
                    item = early.popleft()
                else:
                    wait = self.settings.api_heartbeat_s
                    if result is not None or failing:
                        wait = min(wait, max(0.0, result_by - time.monotonic()))
                    item = await watch.next(wait)
                if item is None:
                    if failing and result is None and time.monotonic() >= result_by:  # no result came
                        stream.finished = True
                        yield _error_event(
                            APIError(500, "The job failed", code="job_failed", job_id=req.job_id)
                        )
                        break
                    if result is not None and time.monotonic() >= result_by:  # its last events never came
                        stream.finished = True
                        for text in self._from_result(req, result, texts):
                            yield text
                        break
                    yield ": keep-alive\n\n"  # an SSE comment: clients and proxies see the stream live
                    continue
                if followed.is_result(item):
                    ended = JobResult.model_validate_json(item.value or b"{}")
                    if ended.tenant != req.tenant:
                        continue
                    if ended.status != "succeeded" and (not texts or failing):  # nothing else will come
                        stream.finished = True
                        yield _error_event(job_error(ended))
                        break
                    result, result_by = ended, time.monotonic() + RESULT_GRACE_S
                    continue
                for event in feed.take(item):  # Failed raises the hub's error; each cut to what is new
                    watch.started()
                    if event.restarted:  # an attempt that could not resume: its output starts over (what
                        # was sent cannot be taken back); the result is checked against the new text alone
                        texts = dict.fromkeys(texts, "")
                    if event.finish_reason in FAILED_FINISHES:  # its error comes with the result
                        failing = True
                        result_by = time.monotonic() + RESULT_GRACE_S
                        if event.text:
                            texts[event.index] = texts.get(event.index, "") + event.text
                            yield self._chunk(
                                req, choices=[self.text_choice(event.index, event.text, None, False)]
                            )
                        continue
                    yield self._chunk(req, choices=[self.chunk_choice(event, event.index not in texts)])
                    texts[event.index] = texts.get(event.index, "") + event.text
                    if event.final:
                        finished = stream.finished = True
                        if req.live.include_usage and event.usage is not None:
                            u = event.usage
                            used = usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
                            yield self._chunk(req, choices=[], usage=used)
                        break
            yield "data: [DONE]\n\n"
        except Timeout as timeout:
            yield _error_event(timed_out(req.job_id, timeout))
        except Exception as exc:  # noqa: BLE001 - the hub's failure (the broker away): the stream's error
            log.warning("stream of %s failed: %s", req.job_id, exc, exc_info=True)
            yield _error_event(APIError(503, f"The queue could not be read: {exc}", code="queue_unavailable"))


class _Stream:
    """A streamed request's job and place, given back however its response ends (`close`, once): its
    follow ends, its tenant's place is given back, and a job whose stream ended before the job did is
    cancelled (its client left, or the bound passed: see ServingEngine._client_left)."""

    def __init__(self, engine: ServingEngine, req: _Request, followed: Followed, slot: Slot) -> None:
        self.engine, self.req, self.followed, self.slot = engine, req, followed, slot
        self.finished = False  # the job's end was streamed (or it had ended): nothing to cancel
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.followed.close()
        self.slot.release()
        if not self.finished:
            self.engine._later(self.engine._client_left(self.req))


def _failed_at_once(item: Any, followed: Followed) -> bool:
    """A token event that ends its job as failed before any text (an engine's refusal)."""
    if followed.is_result(item) or not hasattr(item, "value"):
        return False
    event = TokenEvent.model_validate_json(item.value or b"{}")
    return event.final and event.finish_reason in FAILED_FINISHES and not event.text


def _choice0(result: JobResult):
    from schemas.jobs import Choice

    return Choice(index=0, text=result.output_text or "", finish_reason=result.finish_reason)


def _error_event(error: APIError) -> str:
    return f"data: {json.dumps(error.body(), ensure_ascii=False)}\n\n"


def job_error(result: JobResult) -> APIError:
    """The error answering a job that did not succeed."""
    why = result.error or f"job {result.status}"
    if result.status == "rejected":
        return APIError(400, why, code="invalid_request", job_id=result.job_id)
    if result.status == "expired":
        return APIError(504, why, code="expired", job_id=result.job_id, should_retry=False)
    return APIError(500, why, code=f"job_{result.status}", job_id=result.job_id)


def timed_out(job_id: str, timeout: Timeout) -> APIError:
    where = "started" if timeout.phase == "queued" else "finished"
    return APIError(
        504, f"Job {job_id} has not {where} within {timeout.waited_s:.0f}s; it is still {timeout.phase} and "
        "stays queryable by its id (a retry of this request reattaches to it).",
        code="timeout", job_id=job_id, phase=timeout.phase,
    )  # fmt: skip
