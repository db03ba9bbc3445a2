"""`/metrics`: HTTP request counts and latencies by route and status (Prometheus), one registry per app."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HTTPMetrics:
    """ASGI middleware: counts every request and times it until its last byte (a stream's end included).
    Routes are labelled by their template (`/v1/batches/{batch_id}`), so ids never become label values."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry) -> None:
        self.app = app
        self.requests = Counter(
            "inferq_api_requests", "HTTP requests answered", ("method", "route", "status"), registry=registry
        )
        self.latency = Histogram(
            "inferq_api_request_seconds", "HTTP request latency, to the last byte", ("method", "route"),
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = _route(scope)
            self.requests.labels(scope["method"], route, str(status)).inc()
            self.latency.labels(scope["method"], route).observe(time.perf_counter() - start)


def _route(scope: Scope) -> str:
    matched = getattr(scope.get("route"), "path", None)  # the router says which route took the request
    if matched is not None:
        return matched
    for route in scope["app"].router.routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return getattr(route, "path", "other")
    return "unmatched"


def metrics_endpoint(registry: CollectorRegistry):
    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return metrics
