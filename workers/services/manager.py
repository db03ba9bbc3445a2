"""`inferq up / down / status`: the local services as one unit.

A service whose address (INFERQ_KAFKA, INFERQ_DATABASE_URL) is on loopback is *managed*: `up` starts it
from the state dir and `down` stops it. One elsewhere (a production cluster, compose) is only provisioned:
`up` creates the contract's topics and runs the migrations there, and `status` checks its health.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

from workers.db import migrate
from workers.db.server import without_password
from workers.services import kafka, kafka_jars, postgres, process, tools
from workers.services.paths import ServicePaths, open_private, private_dir
from workers.services.process import ServiceError
from workers.settings import Settings

Say = Callable[[str], None]


@dataclass(frozen=True)
class ServiceStatus:
    name: str  # kafka | postgres
    address: str  # what clients connect to, from the settings
    managed: bool  # on loopback: started and stopped by `inferq up/down` from the state dir
    pid: int | None  # the running process of a managed service, from its pid file
    healthy: bool  # answered a protocol request (Kafka metadata, `SELECT 1`)
    log: str | None  # a managed service's log file

    def to_dict(self) -> dict:
        return asdict(self)


def paths_of(settings: Settings) -> ServicePaths:
    return ServicePaths(state_dir=settings.state_dir, cache_dir=settings.cache_dir)


def up(settings: Settings, say: Say = print, grow_partitions: bool = False) -> list[ServiceStatus]:
    """Start what is not running, wait until it answers, then create topics and run migrations.

    Existing topics with fewer partitions than configured are reported, and grown only with
    `grow_partitions` (growing moves keys to other partitions: see kafka_io/admin.ensure_topics)."""
    paths = paths_of(settings)
    kafka_port = kafka.loopback_port(settings.kafka)
    pg_url = postgres.loopback_url(settings.database_url)
    with _locked(paths):
        password = postgres.ensure_password(paths.postgres_password) if pg_url else ""
        if pg_url:
            settings = replace(settings, database_url=postgres.with_password(settings.database_url, password))
        # Spawn both before waiting on either, so their start-ups overlap.
        kafka_pid = _start_kafka(paths, kafka_port, say) if kafka_port else None
        pg_pid = _start_postgres(paths, pg_url.port, password, say) if pg_url else None

        if pg_pid:
            db_url = settings.database_url
            process.wait_ready(
                "postgres",
                pg_pid,
                lambda: postgres.ping(db_url, "postgres"),
                paths.log("postgres"),
                postgres.START_TIMEOUT_S,
            )
            if postgres.require_password(paths, settings.database_url, password):
                say("postgres: now requires the password in " + str(paths.postgres_password))
            if postgres.ensure_database(settings.database_url):
                say(f"postgres: created database {pg_url.database}")
        elif not postgres.ping(settings.database_url):
            raise ServiceError("PostgreSQL at INFERQ_DATABASE_URL does not answer")
        migrate.upgrade(settings.database_url)
        say(f"postgres: schema at revision {migrate.current(settings.database_url)}")

        if kafka_pid:
            process.wait_ready(
                "kafka",
                kafka_pid,
                lambda: kafka.ping(settings.kafka_connection),
                paths.log("kafka"),
                kafka.START_TIMEOUT_S,
            )
        elif not kafka.ping(settings.kafka_connection):
            raise ServiceError(f"Kafka at INFERQ_KAFKA={settings.kafka} does not answer")
        for change in kafka.ensure_topics(
            settings.kafka_connection,
            settings.topic_partitions(),
            settings.replication_factor,
            grow=grow_partitions,
        ):
            say(f"kafka: {change}")
    return status(settings)


def down(settings: Settings, purge: bool = False, say: Say = print) -> None:
    """Stop the managed services this state dir started (by pid file); `purge` also deletes their data."""
    paths = paths_of(settings)
    if not paths.state_dir.exists():
        say("nothing to stop: no state dir")
        return
    with _locked(paths):
        # Kafka: SIGTERM is its controlled shutdown. PostgreSQL: SIGINT is "fast" shutdown (SIGTERM would
        # wait for every client, including other people's idle connections, to disconnect).
        for name, polite in (("kafka", signal.SIGTERM), ("postgres", signal.SIGINT)):
            pid = process.stop(paths.pid_file(name), polite, timeout_s=60, marker=_marker(paths, name))
            say(f"{name}: stopped (pid {pid})" if pid else f"{name}: not running")
        if purge:
            shutil.rmtree(paths.kafka_dir, ignore_errors=True)
            shutil.rmtree(paths.logs, ignore_errors=True)
            postgres.purge(paths)
            say(f"purged Kafka data in {paths.kafka_dir} and the PostgreSQL cluster in {paths.postgres_home}")


def status(settings: Settings) -> list[ServiceStatus]:
    paths = paths_of(settings)
    kafka_managed = kafka.loopback_port(settings.kafka) is not None
    pg_managed = postgres.loopback_url(settings.database_url) is not None
    return [
        ServiceStatus(
            name="kafka",
            address=settings.kafka,
            managed=kafka_managed,
            pid=process.live_pid(paths.pid_file("kafka"), _marker(paths, "kafka")) if kafka_managed else None,
            healthy=kafka.ping(settings.kafka_connection),
            log=str(paths.log("kafka")) if kafka_managed else None,
        ),
        ServiceStatus(
            name="postgres",
            address=without_password(settings.database_url),
            managed=pg_managed,
            pid=process.live_pid(paths.pid_file("postgres"), _marker(paths, "postgres"))
            if pg_managed
            else None,
            healthy=postgres.ping(settings.database_url),
            log=str(paths.log("postgres")) if pg_managed else None,
        ),
    ]


def _start_kafka(paths: ServicePaths, port: int, say: Say) -> int:
    pid = process.live_pid(paths.pid_file("kafka"), _marker(paths, "kafka"))
    if pid:
        say(f"kafka: already running (pid {pid})")
        return pid
    _require_free(port, "kafka")
    _require_free(port + 1, "kafka controller")
    jars = kafka_jars.ensure_jars(paths.cache_dir, say)
    pid = kafka.start(paths, jars, port)
    process.write_pid(paths.pid_file("kafka"), pid)
    say(f"kafka: started on 127.0.0.1:{port} (pid {pid}, log {paths.log('kafka')})")
    return pid


def _start_postgres(paths: ServicePaths, port: int, password: str, say: Say) -> int:
    pid = process.live_pid(paths.pid_file("postgres"), _marker(paths, "postgres"))
    if pid:
        say(f"postgres: already running (pid {pid})")
        return pid
    _require_free(port, "postgres")
    bindir = tools.postgres_bindir()
    postgres.prepare(paths, bindir, password)
    pid = postgres.start(paths, bindir, port)
    process.write_pid(paths.pid_file("postgres"), pid)
    say(f"postgres: started on 127.0.0.1:{port} (pid {pid}, data {paths.postgres_data})")
    return pid


def _require_free(port: int, name: str) -> None:
    """A port answering without our pid file belongs to someone else: say so, not a bind error."""
    with socket.socket() as sock:
        sock.settimeout(1)
        if sock.connect_ex(("127.0.0.1", port)) == 0:
            raise ServiceError(
                f"{name}: port {port} is in use by a process this state dir did not start; "
                "stop it, or point INFERQ_STATE_DIR at the state dir that started it"
            )


@contextmanager
def _locked(paths: ServicePaths) -> Iterator[None]:
    """One `up`/`down` at a time per state dir (several people and CI may share one checkout)."""
    private_dir(paths.state_dir)
    with os.fdopen(open_private(paths.lock, os.O_WRONLY), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _marker(paths: ServicePaths, service: str) -> str:
    """A path only this state dir's own service has on its command line (Kafka's config, Postgres's -D)."""
    return str(paths.kafka_dir) if service == "kafka" else str(paths.postgres_data)
