"""Factories for the HTTP API tests: a migrated database of their own, `inferq api` processes, keys.

The API's tables come with migration 0007; the tests migrate a database of their own on the shared server
(so the shared database's revision is left as it is), and point the worker and the API processes at it.
Every deployment has its own topic prefix (tests/workers/worker_factories.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from workers.db import migrate
from workers.settings import Settings

MODEL = "tiny-test"  # the name the test API processes serve


@contextlib.contextmanager
def migrated_database(settings: Settings) -> Iterator[str]:
    name = f"inferq_api_{uuid.uuid4().hex[:10]}"
    admin = create_engine(
        make_url(settings.database_url).set(database="postgres"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(settings.database_url).set(database=name).render_as_string(hide_password=False)
    try:
        migrate.upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_of(settings: Settings, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "INFERQ_TOPIC_PREFIX": settings.topic_prefix,
        "INFERQ_KAFKA": settings.kafka,
        "INFERQ_DATABASE_URL": settings.database_url,
        **extra,
    }


def cli(settings: Settings, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args], env=env_of(settings), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def create_key(settings: Settings, tenant: str) -> str:
    """A new key of `tenant`, through `inferq api-key create` (the key is its last line)."""
    done = cli(settings, "api-key", "create", "--tenant", tenant, "--name", "test")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


@dataclasses.dataclass
class APIProcess:
    proc: subprocess.Popen
    base_url: str
    log: Path

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_api(settings: Settings, tmp: Path, **env: str) -> APIProcess:
    port = free_port()
    log = tmp / f"api-{port}.log"
    cmd = [sys.executable, "-m", "workers.cli", "api", "--port", str(port), "--model-name", MODEL]
    proc = subprocess.Popen(cmd, env=env_of(settings, **env), stdout=log.open("wb"), stderr=subprocess.STDOUT)
    api = APIProcess(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, api.output()[-3000:]
        try:
            with urllib.request.urlopen(f"{api.base_url}/health", timeout=2) as r:
                if r.status == 200:
                    return api
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.3)
    api.stop()
    raise AssertionError(f"inferq api never became healthy:\n{api.output()[-3000:]}")


def wait_models(api: APIProcess, key: str, models: list[str], timeout_s: float = 180) -> None:
    """Until /v1/models lists `models`: the deployment's workers have started and announced them."""
    deadline = time.monotonic() + timeout_s
    listed: list[str] = []
    while time.monotonic() < deadline:
        listed = [m.id for m in api.client(key).models.list()]
        if listed == models:
            return
        time.sleep(0.3)
    raise AssertionError(f"/v1/models lists {listed}, not {models}:\n{api.output()[-3000:]}")


def wait_batch(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout_s: float = 180):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.3)


def raw(url: str, method: str = "GET", key: str | None = None, body: bytes | None = None) -> tuple[int, dict]:
    """A request without the SDK (what it would not send): (status, JSON body)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
