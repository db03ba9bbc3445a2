"""The worker's HTTP endpoint: Prometheus metrics at /metrics, and /health for orchestrators.

/health answers 200 while the worker serves and 503 with the reason while its engine steps are failing
(a device fault it will soon give up on), so a load balancer or Kubernetes probe sees it before it exits.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class Health:
    def __init__(self) -> None:
        self._problem: str | None = None

    def set(self, healthy: bool, why: str = "") -> None:
        self._problem = None if healthy else (why or "unhealthy")

    @property
    def problem(self) -> str | None:
        return self._problem


def serve(port: int, registry: CollectorRegistry, health: Health) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] == "/health":
                problem = health.problem
                body, status, kind = (problem or "ok").encode(), 503 if problem else 200, "text/plain"
            else:
                body, status, kind = generate_latest(registry), 200, CONTENT_TYPE_LATEST
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # scrapes are not log lines
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="inferq-metrics", daemon=True).start()
    return server
