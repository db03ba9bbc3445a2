"""What every route of one API process shares: settings, the database engine, the job client, and the two
small thread pools that keep blocking calls off the event loop.

The event loop waits for every request (thousands at once) and holds no thread while it does; what blocks
runs on a pool, each call short: database statements on `db_pool` (as many threads as the engine's pool has
connections, so no call waits for a connection while holding a thread), and the Kafka calls that may wait
for a topic's metadata (a post, a follow) on `kafka_pool`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from workers.api.auth import KeyCache
from workers.api.limits import TenantLimits
from workers.client import JobClient
from workers.client.async_client import AsyncJobClient
from workers.db import Engine
from workers.settings import Settings

T = TypeVar("T")


@dataclass(frozen=True)
class APIContext:
    settings: Settings
    db: Engine
    client: JobClient
    models: tuple[str, ...]  # names a body may give while no worker announces one (--model-name)
    db_pool: ThreadPoolExecutor
    kafka_pool: ThreadPoolExecutor
    keys: KeyCache  # keys found live (and unknown) lately (auth.py)
    limits: TenantLimits = field(default_factory=TenantLimits)  # per-tenant 429s (limits.py); default: off
    jobs: AsyncJobClient = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "jobs", AsyncJobClient(self.client, self.kafka_pool))

    @property
    def max_file_bytes(self) -> int:
        return self.settings.api_max_file_bytes

    @property
    def batch_window_s(self) -> float | None:
        return self.settings.api_batch_window_s

    async def run_db(self, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)` on the database pool (it opens its own connection or transaction)."""
        return await asyncio.get_running_loop().run_in_executor(self.db_pool, call, *args)

    def close(self) -> None:
        self.db_pool.shutdown(wait=True, cancel_futures=True)
        self.kafka_pool.shutdown(wait=True, cancel_futures=True)
