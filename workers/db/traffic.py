"""Client-side counts of this process's database traffic (for `bench pipeline`), from SQLAlchemy events.

statements: every statement sent (an executemany is one); round_trips: what psycopg2 waits for, each
executemany row (it sends them one by one), the pool's pre-ping at each checkout, and BEGIN and COMMIT or
ROLLBACK of each transaction; transactions; checkouts. Off until `count_traffic()` is called.
"""

from __future__ import annotations

import threading

_COUNTS = {"statements": 0, "round_trips": 0, "transactions": 0, "checkouts": 0}
_LOCK = threading.Lock()
_INSTALLED: list[bool] = []


def _count(**deltas: int) -> None:
    with _LOCK:
        for name, n in deltas.items():
            _COUNTS[name] += n


def count_traffic() -> None:
    """Start counting every engine's traffic in this process (once)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine
    from sqlalchemy.pool import Pool

    if _INSTALLED:
        return
    _INSTALLED.append(True)

    @event.listens_for(Engine, "before_cursor_execute")
    def _statement(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001
        rows = len(parameters) if executemany and parameters else 1
        _count(statements=1, round_trips=rows)

    @event.listens_for(Engine, "begin")
    def _begin(conn):  # noqa: ANN001
        _count(transactions=1, round_trips=2)  # BEGIN, and its COMMIT or ROLLBACK

    @event.listens_for(Pool, "checkout")
    def _checkout(dbapi_conn, record, proxy):  # noqa: ANN001
        _count(checkouts=1, round_trips=1)  # pool_pre_ping


def traffic() -> dict[str, int]:
    """The counts so far."""
    with _LOCK:
        return dict(_COUNTS)
