"""Per-job events in the logs: one INFO line each, with structured fields for JSON logs.

The vocabulary: admitted (handed to the engine), started (first scheduled), first_token, finished (with
status and timings), rejected (with reason). Fields are ids, counts, timings and reasons: never a prompt
or an output.

Four lines a job cost the engine thread more than anything else it does for a one-token job (building,
formatting and writing a record: ~40% of its time at 500 jobs/s), so the engine thread only queues an
event (with its time) and a thread of its own writes it, in order, stamped with the time it happened.
Lines still queued at exit are written then (`flush`).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from typing import Any

from workers.logs import FIELDS_ATTR

log = logging.getLogger("inferq.jobs")

EVENTS = ("admitted", "started", "first_token", "finished", "rejected")

_Event = tuple[float, str, str, str, dict[str, Any]]
_queue: queue.SimpleQueue[_Event | None] = queue.SimpleQueue()
_writer: list[threading.Thread] = []
_lock = threading.Lock()


def job_event(event: str, job_id: str, priority: str, **fields: Any) -> None:
    """Log `event` of a job; fields that are None are left out."""
    if not log.isEnabledFor(logging.INFO):
        return
    if not _writer:
        _start()
    _queue.put((time.time(), event, job_id, priority, fields))


def flush(timeout_s: float = 5.0) -> None:
    """Write every event queued so far (the writer thread stops; a later event starts it again)."""
    with _lock:
        if not _writer:
            return
        thread = _writer.pop()
    _queue.put(None)
    thread.join(timeout_s)


def _start() -> None:
    with _lock:
        if not _writer:
            thread = threading.Thread(target=_write, name="inferq-job-log", daemon=True)
            _writer.append(thread)
            thread.start()


def _write() -> None:
    while True:
        item = _queue.get()
        if item is None:
            return
        try:
            _emit(*item)
        except Exception:  # noqa: BLE001 - a log line must never end the thread (later lines would wait)
            logging.getLogger(__name__).exception("a job event could not be logged")


def _emit(at: float, event: str, job_id: str, priority: str, fields: dict[str, Any]) -> None:
    fields = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in fields.items() if v is not None}
    detail = " ".join(f"{k}={v}" for k, v in {"priority": priority, **fields}.items())
    structured = {"event": event, "job_id": job_id, "priority": priority, **fields}
    record = log.makeRecord(
        log.name, logging.INFO, __file__, 0, "job %s %s %s", (event, job_id, detail), None,
        extra={FIELDS_ATTR: structured},
    )  # fmt: skip
    record.created, record.msecs = at, (at - int(at)) * 1000  # when it happened, not when it was written
    log.handle(record)


atexit.register(flush)
