"""The app's wiring: routes to the serving objects and routers, error handlers, metrics, the lifespan
(the database engine, the job client, the batch driver), and running it on uvicorn.

`/health` and `/metrics` are open; every /v1 route needs a bearer key (auth.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from starlette.concurrency import run_in_threadpool

from workers.api import auth, batches, errors, files
from workers.api.auth import KeyCache
from workers.api.batch_driver import BatchDriver
from workers.api.context import APIContext
from workers.api.events import BatchEvents
from workers.api.limits import TenantLimits
from workers.api.metrics import HTTPMetrics, metrics_endpoint
from workers.api.models import adapter_cards, model_not_found
from workers.api.protocol import model_card, page
from workers.api.serving_chat import ServingChat
from workers.api.serving_completion import ServingCompletion
from workers.settings import Settings

log = logging.getLogger(__name__)


def build_app(settings: Settings, models: tuple[str, ...], *, run_driver: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from workers.client import JobClient
        from workers.db.connect import make_engine

        db = make_engine(settings.database_url)
        client = JobClient(settings, database_url=settings.database_url)
        ctx = APIContext(
            settings, db, client, models, settings.api_max_file_bytes, settings.api_request_timeout_s,
            settings.api_batch_window_s, KeyCache(),
            TenantLimits(settings.api_tenant_max_in_flight, settings.api_tenant_rpm),
        )  # fmt: skip
        events = BatchEvents(settings)
        app.state.api = ctx
        app.state.chat, app.state.completion = ServingChat(ctx), ServingCompletion(ctx)
        app.state.driver = BatchDriver(ctx, events) if run_driver else None
        if app.state.driver is not None:
            app.state.driver.start()
        log.info("inferq api: models %s, topic prefix %s", ", ".join(models), settings.topic_prefix)
        try:
            yield
        finally:  # uvicorn has finished the requests in flight (graceful shutdown) before this runs
            if app.state.driver is not None:
                app.state.driver.stop()
            events.close()
            client.close()
            db.dispose()

    app = FastAPI(title="inferq", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    registry = CollectorRegistry()
    app.add_middleware(HTTPMetrics, registry=registry)
    errors.install(app)
    app.add_route("/metrics", metrics_endpoint(registry), methods=["GET"])

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        ctx: APIContext = request.app.state.api

        def ping() -> None:
            with ctx.db.connect() as conn:
                conn.exec_driver_sql("SELECT 1")

        try:
            await run_in_threadpool(ping)
        except Exception as exc:  # noqa: BLE001 - the database away: not ready
            return JSONResponse({"status": "unavailable", "database": str(exc)[:200]}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def list_models(request: Request, tenant: str = Depends(auth.tenant)) -> dict:
        ctx: APIContext = request.app.state.api
        adapters = await run_in_threadpool(adapter_cards, ctx.db, tenant, ctx.default_model)
        return page([model_card(m) for m in ctx.models] + adapters, False)

    @app.get("/v1/models/{model:path}")  # adapter names may hold '/'
    async def get_model(request: Request, model: str, tenant: str = Depends(auth.tenant)) -> dict:
        ctx: APIContext = request.app.state.api
        if model in ctx.models:
            return model_card(model)
        cards = await run_in_threadpool(adapter_cards, ctx.db, tenant, ctx.default_model)
        card = next((c for c in cards if c["id"] == model), None)
        if card is None:
            raise model_not_found(model)
        return card

    @app.post("/v1/chat/completions")
    async def chat(request: Request, tenant: str = Depends(auth.tenant)):
        return await request.app.state.chat.create(request, tenant)

    @app.post("/v1/completions")
    async def completions(request: Request, tenant: str = Depends(auth.tenant)):
        return await request.app.state.completion.create(request, tenant)

    # OpenAI's "get chat completion" (and the same for completions): an earlier answer by its id, from the
    # job's row (a stream whose API process died, a 504's job)
    @app.get("/v1/chat/completions/{completion_id}")
    async def get_chat(request: Request, completion_id: str, tenant: str = Depends(auth.tenant)):
        return await request.app.state.chat.retrieve(completion_id, tenant)

    @app.get("/v1/completions/{completion_id}")
    async def get_completion(request: Request, completion_id: str, tenant: str = Depends(auth.tenant)):
        return await request.app.state.completion.retrieve(completion_id, tenant)

    app.include_router(files.router)
    app.include_router(batches.router)
    return app


def serve(settings: Settings, models: tuple[str, ...], host: str, port: int) -> None:
    """Run until SIGTERM/SIGINT; then stop taking connections, finish the requests in flight (up to 30 s),
    stop the batch driver and close the clients."""
    import signal

    import uvicorn

    # uvicorn raises the signal it stopped on again once it is done, which would end the process with
    # -SIGTERM after a clean shutdown: a handler that ignores that second raise makes the exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    app = build_app(settings, models)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30, access_log=False)
