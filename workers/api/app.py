"""The app's wiring: routes to the serving objects and routers, error handlers, metrics, the lifespan
(the database engine, the job client and its pools, the fleet's models, the batch driver), and running it
on uvicorn.

`/health` and `/metrics` are open; every /v1 route needs a bearer key (auth.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from workers.api import auth, batches, errors, files
from workers.api.auth import KeyCache
from workers.api.batch_driver import BatchDriver
from workers.api.context import APIContext
from workers.api.events import BatchEvents
from workers.api.fleet import Fleet, model_list
from workers.api.job_watch import Starts
from workers.api.limits import TenantLimits
from workers.api.metrics import HTTPMetrics, metrics_endpoint
from workers.api.models import model_not_found
from workers.api.protocol import page
from workers.api.serving_chat import ServingChat
from workers.api.serving_completion import ServingCompletion
from workers.settings import Settings

log = logging.getLogger(__name__)

DB_THREADS = 16  # = the API engine's connections (pool 8 + 8 overflow): no call waits for one on a thread
KAFKA_THREADS = 4
HEALTH_PING_S = 1.0  # how often the database is pinged for /health
HEALTH_FRESH_S = 3.0  # a ping this recent answers /health


class Health:
    """`/health`: whether the database answers. A task pings it every HEALTH_PING_S on a thread and a
    connection of its own, and a probe is answered from the last ping while that is at most HEALTH_FRESH_S
    old: a probe never waits for the database (or for a busy pool) unless the pings have stopped coming."""

    def __init__(self, ctx: APIContext) -> None:
        from workers.db.connect import make_engine

        self.ctx = ctx
        self._db = make_engine(ctx.settings.database_url, pool_size=1, max_overflow=0)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inferq-api-health")
        self._answer: tuple[float, str | None] = (-float("inf"), None)  # (when, problem or None)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._pinging(), name="inferq-api-health")

    async def problem(self) -> str | None:
        at, problem = self._answer
        if time.monotonic() - at <= HEALTH_FRESH_S:
            return problem
        return await self._ping()  # the pings are late (the database hangs): this one tells

    async def _pinging(self) -> None:
        while True:
            await self._ping()
            await asyncio.sleep(HEALTH_PING_S)

    async def _ping(self) -> str | None:
        problem = await asyncio.get_running_loop().run_in_executor(self._pool, self._ping_now)
        self._answer = (time.monotonic(), problem)
        return problem

    def _ping_now(self) -> str | None:
        try:
            with self._db.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
        except Exception as exc:  # noqa: BLE001 - the database away: not ready
            return str(exc)[:200]
        return None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._db.dispose()


def build_app(settings: Settings, models: tuple[str, ...], *, run_driver: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from workers.client import JobClient
        from workers.db.connect import make_engine

        db = make_engine(settings.database_url, pool_size=DB_THREADS // 2, max_overflow=DB_THREADS // 2)
        client = JobClient(settings, database_url=settings.database_url)
        ctx = APIContext(
            settings, db, client, models,
            db_pool=ThreadPoolExecutor(DB_THREADS, thread_name_prefix="inferq-api-db"),
            kafka_pool=ThreadPoolExecutor(KAFKA_THREADS, thread_name_prefix="inferq-api-kafka"),
            keys=KeyCache(bad_key_rpm=settings.api_bad_key_rpm),
            limits=TenantLimits(settings.api_tenant_max_in_flight, settings.api_tenant_rpm),
        )  # fmt: skip
        events = BatchEvents(settings)
        fleet, starts = Fleet(ctx), Starts(ctx)
        app.state.api, app.state.fleet, app.state.health = ctx, fleet, Health(ctx)
        app.state.health.start()
        app.state.chat, app.state.completion = (
            ServingChat(ctx, fleet, starts),
            ServingCompletion(ctx, fleet, starts),
        )
        app.state.driver = (
            BatchDriver(ctx, events, fleet_models=lambda: _served_names(ctx)) if run_driver else None
        )
        if app.state.driver is not None:
            app.state.driver.start()
        _settle_heap()
        log.info("inferq api: topic prefix %s; models while no worker runs: %s", settings.topic_prefix,
                 ", ".join(models) or "none")  # fmt: skip
        try:
            yield
        finally:  # uvicorn has finished the requests in flight (graceful shutdown) before this runs
            if app.state.driver is not None:
                app.state.driver.stop()
            await starts.close()
            await app.state.health.close()
            events.close()
            client.close()
            ctx.close()
            db.dispose()

    app = FastAPI(title="inferq", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    registry = CollectorRegistry()
    app.add_middleware(HTTPMetrics, registry=registry)
    errors.install(app)
    app.add_route("/metrics", metrics_endpoint(registry), methods=["GET"])

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        problem = await request.app.state.health.problem()
        if problem is not None:
            return JSONResponse({"status": "unavailable", "database": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def list_models(request: Request, tenant: str = Depends(auth.tenant)) -> dict:
        return page(await request.app.state.fleet.cards(tenant), False)

    @app.get("/v1/models/{model:path}")  # adapter names may hold '/'
    async def get_model(request: Request, model: str, tenant: str = Depends(auth.tenant)) -> dict:
        for card in await request.app.state.fleet.cards(tenant):
            if card["id"] == model:
                return card
        raise model_not_found(model)

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


GC_THRESHOLDS = (20_000, 20, 20)  # young collections every 20,000 allocations (Python's default: 700)


def _settle_heap() -> None:
    """The objects of start-up (modules, the app, clients) out of the collector's view, and collections
    less often: a burst of 2,000 requests made six full collections of 0.2-1.1 s each, every one a stall
    of the event loop (/health waited behind it); with these, none in the burst and 0.4-0.9 s of
    collections in all. Each request's objects are freed by reference counting as it ends; the rare full
    collection still finds cycles."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _served_names(ctx: APIContext) -> tuple[str, ...]:
    """The names a Batch line may give (on the driver's thread): the live workers' models, else the
    configured ones."""
    from workers.clock import utcnow
    from workers.db import served_models

    with ctx.db.connect() as conn:
        live = served_models.live(conn, ctx.settings.topic_prefix, utcnow())
    return tuple(card["id"] for card in model_list(live)) or ctx.models


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 256 * 1024


def bound_heap_growth() -> None:
    """Allocations of 256 KiB and more get memory of their own, returned when freed. glibc otherwise raises
    this threshold to the largest block freed so far (up to 32 MiB), after which the 1 MiB chunks an upload
    or a batch file moves through (and their escaped copies in the database driver) come from per-thread
    arenas that keep what they held: a refused 300 MiB upload took the process from 92 to 256 MB, and
    with this to 102 MB. Nothing on other C libraries."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except OSError:
        pass


def serve(settings: Settings, models: tuple[str, ...], host: str, port: int) -> None:
    """Run until SIGTERM/SIGINT; then stop taking connections, finish the requests in flight (up to 30 s),
    stop the batch driver and close the clients."""
    import signal
    import sys

    import uvicorn

    # uvicorn raises the signal it stopped on again once it is done, which would end the process with
    # -SIGTERM after a clean shutdown: a handler that ignores that second raise makes the exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    bound_heap_growth()
    # The event loop gives the GIL up at every system call (a socket write, a lock, urandom) and waits for it
    # while the stream hub, the producer's I/O and the database threads run Python: at the default 5 ms
    # switch interval each such wait can last 5 ms, and /health's tail grew with the load (as the worker's
    # engine loop did: settings.switch_interval_s)
    sys.setswitchinterval(settings.switch_interval_s)
    app = build_app(settings, models)
    uvicorn.run(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30, access_log=False,
        backlog=4096,  # a burst of thousands of connections is queued, not refused
        limit_concurrency=None,
    )  # fmt: skip
