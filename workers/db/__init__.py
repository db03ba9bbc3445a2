"""PostgreSQL: the one package that imports SQLAlchemy and psycopg2.

`connect` (an engine whose every call is bounded in time), `jobs` (the jobs table's idempotent
statements), `outbox` (terminal rows as the durable record of their results), `bulk_jobs`, `history`
(the SQL functions and views of job history), `retention` and `maintenance` (deleting and releasing in
batches), `errors` (which database failures are worth retrying), `migrate` (Alembic), `server` (the
server-level calls `inferq up` needs). Callers hold the `Engine`, `Connection` and `Row` handles
exported here without importing SQLAlchemy themselves.
"""

from sqlalchemy import Connection, Engine, Row

__all__ = ["Connection", "Engine", "Row"]
