"""A Server-Sent Events response that notices a client leaving while nothing is being sent.

Starlette's StreamingResponse, on servers that speak ASGI 2.4, learns of a disconnect only when a write
fails: a stream whose job is still queued would keep its job until its next heartbeat. This response
listens for the disconnect beside the stream and stops the stream at once (its generator's `finally` then
cancels the job); `on_close` runs however the response ends (the tenant's place given back).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncIterator[str], headers: dict[str, str], on_close: Callable[[], None]
    ) -> None:
        """(A Response, for the framework: its body is the stream, sent by __call__.)"""
        self.events = events
        self.stream_headers = {**SSE_HEADERS, **headers, "Content-Type": "text/event-stream; charset=utf-8"}
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers(self.stream_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            streaming = asyncio.ensure_future(self._stream(send))
            listening = asyncio.ensure_future(_disconnected(receive))
            try:
                await asyncio.wait((streaming, listening), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (listening, streaming):
                    if not task.done():
                        task.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await streaming  # its generator's finally has run when this returns
                with contextlib.suppress(asyncio.CancelledError):
                    await listening
        finally:
            self.on_close()

    async def _stream(self, send: Send) -> None:
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.stream_headers.items()]
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": raw})
            async for text in self.events:
                await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await _close(self.events)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _close(events: AsyncIterator[str]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()
