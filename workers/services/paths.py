"""Where `inferq up` keeps its state: the state dir, the PostgreSQL cluster dir and the jar cache."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from workers.settings import POSTGRES_PASSWORD_FILE

# PostgreSQL runs as the unprivileged `postgres` user when we are root (initdb refuses root). That user
# cannot traverse a root-only home (/root is mode 700), where a clone may live, so the cluster's data and
# socket live in a per-checkout folder under /tmp (not $TMPDIR, which may be private too), named after a
# hash of the state dir; `.state/postgres` is a symlink to it.
PG_HOME_ROOT = Path("/tmp")


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
