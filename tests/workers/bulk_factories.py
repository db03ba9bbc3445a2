"""Factories for bulk tests: OpenAI Batch lines and files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select

from schemas.tables import bulk_jobs
from workers.settings import Settings

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def batch_line(custom_id: str, url: str = COMPLETIONS, **body: Any) -> dict[str, Any]:
    """A valid Batch request line; body fields override a small default body."""
    base: dict[str, Any] = {"model": "tiny", "max_tokens": 4}  # the test workers' --model, their served name
    if url == COMPLETIONS:
        base["prompt"] = f"prompt of {custom_id}"
    else:
        base["messages"] = [{"role": "user", "content": f"hello from {custom_id}"}]
    base.update(body)
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": base}


def write_batch(path: Path, lines: list[dict[str, Any] | str]) -> Path:
    """One JSON object (or a raw string, for broken lines) per line."""
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def numbered_batch(path: Path, n: int, **body: Any) -> Path:
    """n valid completion lines with custom_ids req-0000, req-0001, ..."""
    return write_batch(path, [batch_line(f"req-{i:04d}", **body) for i in range(n)])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass
class BulkWorkerProcess:
    proc: subprocess.Popen
    log: Path

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown code runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(60)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def cli_env(settings: Settings, state_dir: Path) -> dict[str, str]:
    """The environment a user of this deployment runs `inferq` with."""
    return {**os.environ, "INFERQ_TOPIC_PREFIX": settings.topic_prefix, "INFERQ_KAFKA": settings.kafka,
            "INFERQ_DATABASE_URL": settings.database_url, "INFERQ_STATE_DIR": str(state_dir),
            "OMP_NUM_THREADS": "1"}  # fmt: skip


def start_bulk_worker(
    settings: Settings, state_dir: Path, log: Path, *extra: str, timeout_s: float = 60
) -> BulkWorkerProcess:
    """`inferq bulk-worker` in its own process group, once Celery says it is ready."""
    cmd = [sys.executable, "-m", "workers.cli", "bulk-worker", "--concurrency", "2", *extra]
    proc = subprocess.Popen(cmd, env=cli_env(settings, state_dir), stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    worker = BulkWorkerProcess(proc, log)
    deadline = time.monotonic() + timeout_s
    while " ready." not in worker.output():
        if proc.poll() is not None or time.monotonic() > deadline:
            worker.kill()
            raise AssertionError(f"bulk worker did not start:\n{worker.output()[-3000:]}")
        time.sleep(0.2)
    return worker


def bulk_row(db: Engine, bulk_id: str) -> dict[str, Any]:
    with db.connect() as conn:
        return dict(conn.execute(select(bulk_jobs).where(bulk_jobs.c.bulk_id == bulk_id)).mappings().one())


def wait_bulk(
    db: Engine, bulk_id: str, until, timeout_s: float = 300, poll_s: float = 0.05
) -> dict[str, Any]:
    """Poll the bulk_jobs row until `until(row)` holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = bulk_row(db, bulk_id)
        if until(row):
            return row
        if time.monotonic() > deadline:
            raise AssertionError(f"bulk job {bulk_id} never reached the expected state: {row}")
        time.sleep(poll_s)
