"""Which database failures are worth retrying: the server is away or busy, not the data refused."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout


def db_transient(exc: BaseException) -> bool:
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    # psycopg2 reports lost connections, statement/lock timeouts, serialization failures (40001) and
    # deadlocks (40P01) as OperationalError subclasses.
    return isinstance(exc, OperationalError | InterfaceError | PoolTimeout)
