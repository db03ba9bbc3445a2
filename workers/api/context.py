"""What every route of one API process shares: settings, the database engine, the job client."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.api.auth import KeyCache
from workers.api.limits import TenantLimits
from workers.client import JobClient
from workers.db import Engine
from workers.settings import Settings


@dataclass(frozen=True)
class APIContext:
    settings: Settings
    db: Engine
    client: JobClient
    models: tuple[str, ...]  # the served model names /v1/models lists; a body may name one of them
    max_file_bytes: int
    request_timeout_s: float  # how long a non-streaming request waits for its job (then 504)
    batch_window_s: float | None  # tests: a shorter completion window than the 24h asked for
    keys: KeyCache  # keys found live lately (auth.py)
    limits: TenantLimits = field(default_factory=TenantLimits)  # per-tenant 429s (limits.py); default: off

    @property
    def default_model(self) -> str:
        return self.models[0]
