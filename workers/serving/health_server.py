"""The worker's HTTP endpoint: Prometheus metrics at /metrics, and /health for orchestrators.

/health answers 200 while the worker serves and 503 with the reasons while something is wrong: its engine
steps are failing (a device fault it will soon give up on), or it has been out of its consumer group too long
(it reads no jobs), so a load balancer or Kubernetes probe sees it.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class Health:
    """One verdict per concern ("engine", "group"), so one recovering does not hide another still failing."""

    def __init__(self) -> None:
        self._problems: dict[str, str] = {}

    def set(self, healthy: bool, why: str = "", concern: str = "engine") -> None:
        if healthy:
            self._problems.pop(concern, None)
        else:
            self._problems[concern] = why or "unhealthy"

    @property
    def problem(self) -> str | None:
        return "; ".join(self._problems.values()) or None


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
