"""`inferq api`: the OpenAI-compatible HTTP API (workers/api/)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "api",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve OpenAI's /v1/models, /v1/chat/completions, /v1/completions (SSE streaming), "
        "/v1/files and /v1/batches in front of the queue, with /health and /metrics. Stateless: run as "
        "many as needed behind a load balancer. Keys: `inferq api-key create`. SIGTERM: finish requests "
        "in flight (up to 30 s), then exit.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument(
        "--model-name",
        action="append",
        default=None,
        help="a model name a body may give while no worker of the deployment runs, its jobs waiting in the "
        "queue (repeatable; default: INFERQ_SERVED_MODEL_NAME). /v1/models lists what the live workers "
        "announce (inferq worker --served-model-name), whatever this says",
    )
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    from workers.api.app import serve as run
    from workers.logs import configure
    from workers.settings import Settings

    configure("INFO", "text", "api")
    settings = Settings.from_env()
    names = [n.strip() for n in settings.served_model_name.split(",") if n.strip()]
    models = tuple(args.model_name or names)
    run(settings, models, args.host, args.port)
    return 0
