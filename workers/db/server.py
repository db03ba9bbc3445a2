"""Server-level calls on PostgreSQL that `inferq up` needs: is it up, make the database, set the password.

These run before the schema exists, often as the superuser of a fresh local cluster, so they use a plain
psycopg2 connection with a short connect timeout rather than the pooled engine of `connect`.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg2
from sqlalchemy.engine import make_url

_LOOPBACK = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class Address:
    host: str
    port: int
    database: str | None


def loopback_url(url: str) -> Address | None:
    """Where the URL points if that is this machine (a cluster `inferq up` manages), else None."""
    parsed = make_url(url)
    if parsed.host not in _LOOPBACK or parsed.port is None:
        return None
    return Address(parsed.host, parsed.port, parsed.database)


def with_password(url: str, password: str) -> str:
    """The URL with this password, unless it names one itself."""
    parsed = make_url(url)
    if parsed.password:
        return url
    return parsed.set(password=password).render_as_string(hide_password=False)


def without_password(url: str) -> str:
    """The URL as it may be shown (the password masked)."""
    return make_url(url).render_as_string(hide_password=True)


def ping(url: str, database: str | None = None, timeout_s: int = 2) -> bool:
    """True when `SELECT 1` succeeds (in `database` if given, else the URL's own)."""
    try:
        conn = _connect(url, database, timeout_s)
    except psycopg2.Error:
        return False
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1")
            return cur.fetchone() == (1,)
    except psycopg2.Error:
        return False
    finally:
        conn.close()


def ensure_database(url: str) -> bool:
    """Create the URL's database if missing; True if it was created."""
    name = make_url(url).database
    conn = _connect(url, "postgres", 5)
    conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if cur.fetchone():
                return False
            cur.execute(f'CREATE DATABASE "{name}"')
            return True
    finally:
        conn.close()


def set_password(url: str, password: str) -> None:
    """The superuser's password (over a connection the server still trusts)."""
    _run(url, "ALTER ROLE postgres PASSWORD %s", (password,))


def reload_config(url: str) -> None:
    """Make the server re-read pg_hba.conf and postgresql.conf."""
    _run(url, "SELECT pg_reload_conf()", ())


def _run(url: str, sql: str, params: tuple) -> None:
    conn = _connect(url, "postgres", 5)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params)
    finally:
        conn.close()


def _connect(url: str, database: str | None, timeout_s: int):
    u = make_url(url)
    return psycopg2.connect(
        host=u.host,
        port=u.port,
        user=u.username,
        password=u.password,
        dbname=database or u.database,
        connect_timeout=timeout_s,
    )
