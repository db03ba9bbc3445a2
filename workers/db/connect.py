"""Connecting to PostgreSQL: one engine per process, every call bounded in time."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url

# Bounds on every database call, so an unreachable or wedged server surfaces as an error to retry
# instead of a thread blocked forever. The URL's own query (sslmode, options, ...) wins where it sets one.
CONNECT_TIMEOUT_S = 5
STATEMENT_TIMEOUT_MS = 15_000
LOCK_TIMEOUT_MS = 5_000


def make_engine(
    database_url: str,
    statement_timeout_ms: int = STATEMENT_TIMEOUT_MS,
    pool_size: int = 4,
    max_overflow: int = 10,
) -> Engine:
    """`pool_size` connections kept, up to `max_overflow` more while busy."""
    url = make_url(database_url)
    connect_args: dict[str, Any] = {
        "connect_timeout": CONNECT_TIMEOUT_S,
        # TCP keepalives: a server that vanished (host down, network cut) is noticed within ~30 s
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
    }
    if "options" not in url.query:
        connect_args["options"] = (
            f"-c statement_timeout={statement_timeout_ms} -c lock_timeout={LOCK_TIMEOUT_MS}"
        )
    connect_args = {k: v for k, v in connect_args.items() if k not in url.query}
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=CONNECT_TIMEOUT_S,
        hide_parameters=True,  # prompts and outputs never reach the logs through error messages
        connect_args=connect_args,
    )
