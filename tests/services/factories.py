"""Factories for service tests: the CLI as a subprocess, and a private instance of the services."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from workers.settings import Settings


def run_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """`inferq ARGS` in a new process (as a user runs it), with output captured."""
    done = subprocess.run(
        [sys.executable, "-m", "workers.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"inferq {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done


def free_port_pair() -> int:
    """A free port p with p + 1 free too (Kafka's controller listens on the next port)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no free pair of ports")


@dataclass(frozen=True)
class PrivateServices:
    """Kafka + PostgreSQL of their own (state dir, ports), so kill -9 and `down` disturb nobody else."""

    env: dict[str, str]

    @property
    def settings(self) -> Settings:
        """As a process started with this environment sees them (with the password once `up` made it)."""
        return Settings.from_env(self.env)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run_cli(*args, env=self.env, check=check)

    def status(self) -> dict[str, dict]:
        return json.loads(self.cli("status", "--json", check=False).stdout)["services"]


def make_private_services(state_dir: Path) -> PrivateServices:
    kafka_port, pg_port = free_port_pair(), free_port_pair()
    env = {
        **os.environ,
        "INFERQ_STATE_DIR": str(state_dir),
        "INFERQ_KAFKA": f"127.0.0.1:{kafka_port}",
        "INFERQ_DATABASE_URL": f"postgresql+psycopg2://postgres@127.0.0.1:{pg_port}/inferq",
        "INFERQ_TOPIC_PREFIX": "inferq",
        "INFERQ_CACHE": str(Settings.from_env().cache_dir),
    }
    return PrivateServices(env=env)
