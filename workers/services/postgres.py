"""A private PostgreSQL cluster: initdb into a per-checkout dir, run on its own port, loopback only."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
from pathlib import Path

from workers.db import server
from workers.db.server import ensure_database as ensure_database  # noqa: F401 - part of `inferq up`
from workers.db.server import loopback_url as loopback_url  # noqa: F401
from workers.db.server import ping as ping  # noqa: F401
from workers.db.server import with_password as with_password  # noqa: F401
from workers.services import process
from workers.services.paths import ServicePaths, private_dir
from workers.services.process import ServiceError

PG_USER = "postgres"  # the system user of the Debian package (initdb refuses root); also the superuser
START_TIMEOUT_S = 60.0
# psycopg2 interpolates parameters on the client, so a statement's text holds its values (a failing
# admission batch: every prompt in it). The server log gets no statement text, neither for an error nor
# for a slow or sampled statement, and of an error only its primary message: its DETAIL (the failing row,
# the duplicate key) and CONTEXT (the JSON input) quote values too. Set on the command line, which
# postgresql.conf and ALTER SYSTEM cannot override.
LOG_OPTIONS = {
    "log_statement": "none",
    "log_min_error_statement": "panic",
    "log_error_verbosity": "terse",
    "log_min_duration_statement": "-1",
    "log_min_duration_sample": "-1",
    "log_transaction_sample_rate": "0",
    "log_parameter_max_length": "0",
    "log_parameter_max_length_on_error": "0",
}
SERVER_OPTIONS = [
    "-c",
    "listen_addresses=127.0.0.1",
    "-c",
    "max_connections=200",
    *(arg for name, value in LOG_OPTIONS.items() for arg in ("-c", f"{name}={value}")),
]
# Every connection, socket or TCP, proves the generated password (SCRAM); nothing is trusted by address.
PG_HBA = """# written by `inferq up`: the superuser password (state dir, mode 0600) for every connection
local   all   all                  scram-sha-256
host    all   all   127.0.0.1/32   scram-sha-256
host    all   all   ::1/128        scram-sha-256
"""


def ensure_password(path: Path) -> str:
    """The cluster's superuser password: generated once into `path` (mode 0600), then read from it."""
    if not path.exists():
        private_dir(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24))
    return path.read_text().strip()


def prepare(paths: ServicePaths, bindir: Path, password: str) -> None:
    """Create the cluster on first use; a fresh state dir gets a fresh cluster (see paths.py)."""
    home, data = paths.postgres_home, paths.postgres_data
    if not paths.postgres_link.is_symlink() and home.exists():
        _refuse_if_running(data)
        shutil.rmtree(home)  # left by an earlier, since deleted, state dir at this same path
    home.mkdir(mode=0o700, exist_ok=True)
    user = _run_as()
    if user:
        entry = pwd.getpwnam(user)
        os.chown(home, entry.pw_uid, entry.pw_gid)
    if not (data / "PG_VERSION").exists():
        _initdb(home, data, bindir, password, user)
    if not paths.postgres_link.is_symlink():
        paths.postgres_link.symlink_to(home)
    major = (data / "PG_VERSION").read_text().strip()
    if bindir.parent.name != major:
        raise ServiceError(
            f"the cluster in {data} is PostgreSQL {major} but the server found is "
            f"{bindir.parent.name}; install postgresql-{major} or `inferq down --purge`"
        )


def _initdb(home: Path, data: Path, bindir: Path, password: str, user: str | None) -> None:
    # initdb reads the password from a file the server's user can read; it is removed right after
    pwfile = home / "initdb-password"
    pwfile.write_text(password)
    pwfile.chmod(0o600)
    if user:
        entry = pwd.getpwnam(user)
        os.chown(pwfile, entry.pw_uid, entry.pw_gid)
    initdb = [
        str(bindir / "initdb"),
        "-D",
        str(data),
        "-U",
        PG_USER,
        "--pwfile",
        str(pwfile),
        "-A",
        "scram-sha-256",
        "-E",
        "UTF8",
        "--locale=C",
        "--no-instructions",
    ]
    try:
        done = subprocess.run(initdb, capture_output=True, text=True, user=user, stdin=subprocess.DEVNULL)
    finally:
        pwfile.unlink(missing_ok=True)
    if done.returncode != 0:
        raise ServiceError(f"initdb failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")


def require_password(paths: ServicePaths, url: str, password: str) -> bool:
    """Turn a cluster made before passwords (trust) into one that requires them; True if it changed.

    While pg_hba.conf still trusts, the password is set through a trusted connection, then the SCRAM
    rules replace it and the server reloads its configuration.
    """
    hba = paths.postgres_data / "pg_hba.conf"
    if hba.read_text() == PG_HBA:
        return False
    server.set_password(url, password)
    hba.write_text(PG_HBA)
    server.reload_config(url)  # over a connection opened while the old rules still trusted it
    return True


def start(paths: ServicePaths, bindir: Path, port: int) -> int:
    _wait_for_orphans(paths.postgres_data)
    argv = [
        str(bindir / "postgres"),
        "-D",
        str(paths.postgres_data),
        "-p",
        str(port),
        "-k",
        str(paths.postgres_home),
        *SERVER_OPTIONS,
    ]
    return process.spawn(argv, paths.log("postgres"), user=_run_as(), cwd=paths.postgres_home)


def purge(paths: ServicePaths) -> None:
    shutil.rmtree(paths.postgres_home, ignore_errors=True)
    paths.postgres_link.unlink(missing_ok=True)


def _run_as() -> str | None:
    if not process.is_root():
        return None
    try:
        pwd.getpwnam(PG_USER)
    except KeyError:
        raise ServiceError(
            f"running as root, PostgreSQL needs the `{PG_USER}` system user, which the "
            "postgresql-15 package creates: apt-get install postgresql-15"
        ) from None
    return PG_USER


def _refuse_if_running(data: Path) -> None:
    try:
        pid = int((data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    import psutil

    if psutil.pid_exists(pid):
        raise ServiceError(
            f"a PostgreSQL (pid {pid}) still runs from {data}, which belongs to no state "
            f"dir; stop it (`kill -INT {pid}`) and run `inferq up` again"
        )


def _wait_for_orphans(data: Path, timeout_s: float = 30.0) -> None:
    """After a kill -9 of the server, wait until its children (their cwd is the data dir) have noticed and
    exited: while they hold the old shared memory, a new server refuses to start."""
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        orphans = [p.pid for p in psutil.process_iter(["cwd", "status"]) if _is_live_in(p.info, data)]
        if not orphans:
            return
        time.sleep(process.POLL_S)
    raise ServiceError(f"processes {orphans} of an earlier PostgreSQL still run from {data}; stop them first")


def _is_live_in(info: dict, data: Path) -> bool:
    return info["cwd"] == str(data) and info["status"] != "zombie"
