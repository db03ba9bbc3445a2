"""Where `inferq up` keeps its state: the state dir, the PostgreSQL cluster dir and the jar cache."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from workers.settings import POSTGRES_PASSWORD_FILE

# PostgreSQL runs as the unprivileged `postgres` user when we are root (initdb refuses root). That user
# cannot traverse a root-only home (/root is mode 700), where a clone may live, so the cluster's data and
# socket live in a per-checkout folder under /tmp (not $TMPDIR, which may be private too), named after a
# hash of the state dir; `.state/postgres` is a symlink to it.
PG_HOME_ROOT = Path("/tmp")

# The state holds prompts (the services' logs, Kafka's segments, bulk files) and the database password:
# owner-only, whatever the umask of whoever runs `inferq up`.
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
PRIVATE_UMASK = 0o077  # of the services' processes, for the files they create themselves


def private_dir(path: Path) -> Path:
    """`path`, made owner-only with any missing parents; a folder that exists already is left as it is
    (the state dir may be one the operator chose, even a shared one)."""
    missing, folder = [], path
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:  # made meanwhile by another `inferq` process
            continue
        folder.chmod(PRIVATE_DIR_MODE)  # mkdir's mode passes through the umask
    return path


def open_private(path: Path, flags: int) -> int:
    """A descriptor on `path` (os.open `flags`), the file created owner-only, or made so: it is ours."""
    fd = os.open(path, flags | os.O_CREAT, PRIVATE_FILE_MODE)
    os.fchmod(fd, PRIVATE_FILE_MODE)
    return fd


def write_private(path: Path, text: str) -> None:
    with os.fdopen(open_private(path, os.O_WRONLY | os.O_TRUNC), "w") as f:
        f.write(text)


@dataclass(frozen=True)
class ServicePaths:
    state_dir: Path  # per checkout: Kafka data, logs, pid files, the link to the PostgreSQL dir
    cache_dir: Path  # shared by checkouts: the Kafka jars

    @property
    def lock(self) -> Path:
        return self.state_dir / "lock"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    def log(self, service: str) -> Path:
        return self.logs / f"{service}.log"

    def pid_file(self, service: str) -> Path:
        return self.state_dir / f"{service}.pid"

    @property
    def kafka_dir(self) -> Path:
        return self.state_dir / "kafka"

    @property
    def kafka_data(self) -> Path:
        return self.kafka_dir / "data"

    @property
    def postgres_password(self) -> Path:
        return self.state_dir / POSTGRES_PASSWORD_FILE

    @property
    def postgres_link(self) -> Path:
        return self.state_dir / "postgres"

    @property
    def postgres_home(self) -> Path:
        digest = hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:12]
        return PG_HOME_ROOT / f"inferq-pg-{digest}"

    @property
    def postgres_data(self) -> Path:
        return self.postgres_home / "data"
