"""The PostgreSQL that `inferq up` starts never writes a statement's values (prompts) to its server log.

psycopg2 interpolates parameters on the client, so a statement's text holds every value: a failing
admission batch would put every prompt in it into the log. A cluster of its own (state dir, port) is
prepared and started by the very functions `inferq up` uses, so the shared one is not disturbed.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError

from tests.services.factories import free_port_pair
from workers.services import postgres, process, tools
from workers.services.paths import ServicePaths

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Cluster:
    url: str
    log: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    state = tmp_path_factory.mktemp("pg-state")
    paths = ServicePaths(state_dir=state, cache_dir=state / "cache")
    password = postgres.ensure_password(paths.postgres_password)
    bindir, port = tools.postgres_bindir(), free_port_pair()
    url = f"postgresql+psycopg2://postgres:{password}@127.0.0.1:{port}/postgres"
    try:
        postgres.prepare(paths, bindir, password)
        pid = postgres.start(paths, bindir, port)
        process.write_pid(paths.pid_file("postgres"), pid)
        process.wait_ready("postgres", pid, lambda: postgres.ping(url), paths.log("postgres"), 60)
        yield Cluster(url, paths.log("postgres"))
    finally:
        marker = str(paths.postgres_data)  # as `inferq down` stops it
        process.stop(paths.pid_file("postgres"), signal.SIGINT, timeout_s=30, marker=marker)
        postgres.purge(paths)


def _fails(conn, sql: str, **params: object) -> None:
    with pytest.raises(DBAPIError):
        conn.execute(text(sql), params)
    conn.rollback()


def test_a_failing_statement_leaves_its_values_out_of_the_server_log(cluster: Cluster) -> None:
    secret = f"prompt-secret-{uuid.uuid4().hex}"
    engine = create_engine(cluster.url)
    try:
        with engine.connect() as conn:
            conn.execute(text("CREATE TABLE jobs_like (job_id text PRIMARY KEY, prompt text, params jsonb)"))
            conn.execute(text("CREATE TABLE short (prompt text CHECK (length(prompt) < 10))"))
            conn.execute(text("INSERT INTO jobs_like VALUES (:k, 'x', '{}')"), {"k": secret})
            conn.commit()
            # an admission batch: one job's metadata holds a lone surrogate (JSON escapes it as \ud800)
            batch = "INSERT INTO jobs_like VALUES ('a', :p, '{}'), ('b', 'x', CAST(:meta AS jsonb))"
            _fails(conn, batch, p=secret, meta='{"note": "' + secret + '", "bad": "\\ud800"}')
            _fails(conn, "INSERT INTO short VALUES (:p)", p=secret)  # DETAIL: the failing row
            _fails(conn, "INSERT INTO jobs_like VALUES (:k, 'x', '{}')", k=secret)  # DETAIL: the key
            _fails(conn, "SELECT CAST(:j AS jsonb)", j='{"prompt": "' + secret + '" oops}')  # CONTEXT
            _fails(conn, "SELECT 1 / 0")  # the last error: once it is logged, all of them are
    finally:
        engine.dispose()

    deadline = time.monotonic() + 10
    while "division by zero" not in (logged := cluster.log.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"the errors never reached {cluster.log}:\n{logged[-3000:]}"
        time.sleep(0.2)
    # the errors themselves are logged ...
    assert logged.count("ERROR:  invalid input syntax for type json") == 2
    assert "violates check constraint" in logged and "duplicate key value" in logged
    # ... without the statement, its values, the failing row or the JSON input
    assert secret not in logged
    assert "STATEMENT:" not in logged and "DETAIL:" not in logged and "CONTEXT:" not in logged
