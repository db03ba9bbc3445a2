"""What the demo shows: the jobs' streams (live in a terminal, plain blocks otherwise), then their rows."""

from __future__ import annotations

import subprocess
import sys
import time

from rich.console import Console
from rich.live import Live

from schemas.statuses import TERMINAL_STATUSES
from workers.client.token_events import TokenEventReader
from workers.db.connect import make_engine
from workers.db.job_queries import summaries
from workers.demo.board import DemoBoard, render_live, render_plain
from workers.settings import Settings


def follow_tokens(
    settings: Settings,
    board: DemoBoard,
    since_ms: int,
    timeout_s: float,
    worker: subprocess.Popen | None = None,
) -> dict[str, str]:
    """Read token events into the board until every job's final event; returns the streamed texts.

    In a terminal each job's panel grows in place (rich Live); otherwise each job's final text is printed
    once, as a plain block, when it ends.
    """
    reader = TokenEventReader(settings, since_ms, "inferq-demo")
    console = Console()
    live = Live(render_live(board), console=console, refresh_per_second=8, transient=True)
    deadline = time.monotonic() + timeout_s
    try:
        if console.is_terminal:
            live.start()
        while not board.done and time.monotonic() < deadline:
            if worker is not None and worker.poll() is not None:
                raise RuntimeError(f"the worker exited with code {worker.returncode}; see its log")
            for event in reader.poll(0.1):
                stream = board.apply(event, time.monotonic())
                if stream is not None and stream.done and not console.is_terminal:
                    print(render_plain(stream), flush=True)
            if console.is_terminal:
                live.update(render_live(board))
    finally:
        live.stop()  # transient: the live region goes, and the final state is printed once below
        reader.close()
    if console.is_terminal:
        console.print(render_live(board))
    if not board.done:
        print(f"timed out after {timeout_s:.0f} s waiting for the final token events", file=sys.stderr)
    return board.texts()


def wait_for_rows(settings: Settings, job_ids: list[str], timeout_s: float) -> list[dict]:
    """The jobs' rows once all are terminal (results are published only after the rows commit)."""
    db = make_engine(settings.database_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with db.connect() as conn:
                rows = summaries(conn, job_ids, "attempts", "output_text")
            if (len(rows) == len(job_ids) and all(r["status"] in TERMINAL_STATUSES for r in rows)) or (
                time.monotonic() > deadline
            ):
                order = {job_id: i for i, job_id in enumerate(job_ids)}
                return sorted(rows, key=lambda r: order[r["job_id"]])
            time.sleep(0.2)
    finally:
        db.dispose()
