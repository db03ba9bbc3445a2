"""A chat or completion request as a job on the queue: checked, submitted with the key's tenant, then
either waited for (one JSON answer) or streamed (Server-Sent Events from the token topic).

The body is checked and turned into a job by the bulk path's rules (parse_line, to_job), and the answer
is built by the bulk path's `response_body`, so a request answers exactly as the same body does as a
Batch line. Each endpoint (serving_chat, serving_completion) adds only its stream chunks' shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from schemas.jobs import JobRequest, JobResult, TokenEvent
from schemas.statuses import TERMINAL_STATUSES
from workers.api.bodies import job_of_body
from workers.api.context import APIContext
from workers.api.errors import APIError, not_found
from workers.api.limits import Slot
from workers.api.models import ModelNames, job_model
from workers.api.protocol import LiveOptions, split_live_options, usage
from workers.bulk.batch_format import BatchLine
from workers.bulk.output import response_body
from workers.client import DeliveryFailed, JobTimeout, Submitted
from workers.db.job_queries import job_row
from workers.db.outbox import result_from_row

log = logging.getLogger(__name__)

_END = object()
_DISCONNECT_CHECK_S = 0.25  # how often a stream looks whether its client is still there


async def json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    return body


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
        "finished_at": result.timings.finished_at,
        "created_at": result.timings.created_at,
        "error": result.error,
    }


class ServingEngine:
    url: str  # the endpoint, as a Batch line names it
    id_prefix: str  # of the job ids (and so of the response ids)
    kind: str  # the `object` of a stream chunk

    def __init__(self, ctx: APIContext) -> None:
        self.ctx = ctx

    # ---- the endpoint's own shapes ---------------------------------------------------------------------
    def chunk_choice(self, event: TokenEvent, first: bool) -> dict[str, Any]:
        raise NotImplementedError

    # ---- a request -------------------------------------------------------------------------------------
    async def create(self, request: Request, tenant: str) -> JSONResponse | StreamingResponse:
        slot = self.ctx.limits.hold(tenant)  # the tenant's requests in flight here (off by default): 429
        try:
            response = await self._create(request, tenant, slot)
        except BaseException:
            slot.release()
            raise
        if not isinstance(response, StreamingResponse):
            slot.release()
        return response

    async def _create(self, request: Request, tenant: str, slot: Slot) -> JSONResponse | StreamingResponse:
        """The response; a stream releases `slot` when it ends (or its generator is collected unstarted)."""
        body, live = split_live_options(await json_body(request))
        model = body.get("model")
        if isinstance(model, str) and model not in self.ctx.models:  # an adapter, or 404: the registry says
            names = ModelNames(self.ctx.db, self.ctx.models, tenant)
            await run_in_threadpool(names.job_model, model)
        line, job = self.to_job(body, tenant)
        job = job.model_copy(update={"model": job_model(job.model, self.ctx.models)})
        request.state.job_id = job.job_id
        if live.stream:  # only a streamed answer reads token events (a Batch line's job has none)
            job = job.model_copy(update={"stream": True})
            sent = await run_in_threadpool(self._submit, job, live.priority)
            events = self._sse(request, sent, line, live, slot)
            weakref.finalize(events, slot.release)  # a stream never started (its client left at once)
            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Job-Id": job.job_id},
            )
        result, queue_s = await run_in_threadpool(self._run, job, live.priority)
        # Server-Timing: the time spent in the queue (JobClient's submit and wait); the rest of a request's
        # latency is the API's own (bench/api/overhead.py)
        headers = {"X-Job-Id": job.job_id, "Server-Timing": f"queue;dur={queue_s * 1000:.3f}"}
        return JSONResponse(self.answer(line, result), headers=headers)

    async def retrieve(self, job_id: str, tenant: str) -> JSONResponse:
        """The answer to an earlier request of this tenant, by its id (= its job id), built from its jobs row:
        any API process finds it, also after the one that took the request died or timed out (504)."""

        def look_up() -> Any:
            with self.ctx.db.connect() as conn:
                return job_row(conn, job_id, tenant)

        row = await run_in_threadpool(look_up) if job_id.startswith(f"{self.id_prefix}-") else None
        if row is None:
            raise not_found("completion", job_id)
        if row.status not in TERMINAL_STATUSES:
            raise APIError(
                409, f"Job {job_id} is {row.status}: it has no answer yet.", code="job_not_finished",
                job_id=job_id, status=row.status,
            )  # fmt: skip
        line = BatchLine(1, job_id, self.url, self.ctx.default_model, {})
        return JSONResponse(self.answer(line, result_from_row(row)), headers={"X-Job-Id": job_id})

    def to_job(self, body: dict[str, Any], tenant: str) -> tuple[BatchLine, JobRequest]:
        """The job of a body, checked by the Batch path's rules (fields refused by name, the job's limits,
        the output constraint): a body means here what it means as a Batch line."""
        job_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        return job_of_body(self.url, body, tenant, self.ctx.default_model, job_id)

    def _run(self, job: JobRequest, priority: str) -> tuple[JobResult, float]:
        """Submit and wait, in one trip to a worker thread; and the seconds that took."""
        started = time.perf_counter()
        result = self._wait(self._submit(job, priority))
        return result, time.perf_counter() - started

    def _submit(self, job: JobRequest, priority: str) -> Submitted:
        try:
            return self.ctx.client.submit(job, priority)
        except DeliveryFailed as exc:
            raise APIError(
                503, f"The queue did not take the request: {exc}", code="queue_unavailable"
            ) from None

    def _wait(self, sent: Submitted) -> JobResult:
        try:
            return self.ctx.client.wait(sent, self.ctx.request_timeout_s, tenant=sent.tenant)
        except JobTimeout:
            raise APIError(
                504, f"No result within {self.ctx.request_timeout_s:g}s; job {sent.job_id} is still queued "
                "or running and stays queryable by its id.", code="timeout", job_id=sent.job_id,
            ) from None  # fmt: skip
        finally:
            self.ctx.client.forget(sent)

    def answer(self, line: BatchLine, result: JobResult) -> dict[str, Any]:
        if result.status == "succeeded":
            return response_body(line, result_row(result))
        why = result.error or f"job {result.status}"
        if result.status == "rejected":
            raise APIError(400, why, code="invalid_request", job_id=result.job_id)
        if result.status == "expired":
            raise APIError(504, why, code="expired", job_id=result.job_id)
        raise APIError(500, why, code=f"job_{result.status}", job_id=result.job_id)

    # ---- streaming -------------------------------------------------------------------------------------
    def _chunk(self, sent: Submitted, model: str | None, created: int, **fields: Any) -> str:
        chunk = {"id": sent.job_id, "object": self.kind, "created": created, "model": model, **fields}
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    async def _sse(
        self, request: Request, sent: Submitted, line: BatchLine, live: LiveOptions, slot: Slot
    ) -> AsyncIterator[str]:
        """The job's token events as chunks, then `data: [DONE]`. A client gone before the end cancels it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        created = int(time.time())

        def pump() -> None:  # the client's stream blocks: read it in a thread, hand events to the loop
            events = self.ctx.client.stream(sent, self.ctx.request_timeout_s, tenant=sent.tenant)
            try:
                for event in events:
                    loop.call_soon_threadsafe(queue.put_nowait, event)
                    if stop.is_set():
                        break
                loop.call_soon_threadsafe(queue.put_nowait, _END)
            except Exception as exc:  # noqa: BLE001 - JobTimeout, a broker error: the stream's error
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                events.close()
                self.ctx.client.forget(sent)

        threading.Thread(target=pump, name=f"sse-{sent.job_id}", daemon=True).start()
        finished, started = False, set()
        looked = time.monotonic()
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), _DISCONNECT_CHECK_S)
                except TimeoutError:
                    item = None
                # uvicorn drops what is sent to a client that left, and says so only when asked
                if time.monotonic() - looked >= _DISCONNECT_CHECK_S:
                    looked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if item is None:
                    continue
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    error = APIError(504 if isinstance(item, JobTimeout) else 500, str(item), code="stream")
                    yield f"data: {json.dumps(error.body())}\n\n"
                    break  # not finished: the job is cancelled below
                event: TokenEvent = item
                choice = self.chunk_choice(event, event.index not in started)
                started.add(event.index)
                yield self._chunk(sent, line.model, created, choices=[choice])
                if event.final:
                    finished = True
                    if live.include_usage:
                        used = usage(event.usage.prompt_tokens, event.usage.completion_tokens)
                        yield self._chunk(sent, line.model, created, choices=[], usage=used)
            yield "data: [DONE]\n\n"
        finally:
            stop.set()
            slot.release()
            if not finished:
                log.info("stream of %s ended before its job: cancelling it", sent.job_id)
                # a thread, not an await: when the client left, this task is being cancelled, and any
                # await here would be cancelled with it
                threading.Thread(target=self._cancel, args=(sent,), name=f"cancel-{sent.job_id}").start()

    def _cancel(self, sent: Submitted) -> None:
        try:
            self.ctx.client.cancel(sent, sent.tenant)
            log.info("cancel of %s sent", sent.job_id)
        except DeliveryFailed as exc:
            log.warning("cancel of %s not delivered: %s", sent.job_id, exc)
