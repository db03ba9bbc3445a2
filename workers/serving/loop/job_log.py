"""Per-job events in the logs: one INFO line each, with structured fields for JSON logs.

The vocabulary: admitted (handed to the engine), started (first scheduled), first_token, finished (with
status and timings), rejected (with reason). Fields are ids, counts, timings and reasons: never a prompt
or an output.

Four lines a job cost the engine thread more than anything else it does for a one-token job (building,
formatting and writing a record: ~40% of its time at 500 jobs/s), so the engine thread only queues an
event (with its time) and a thread of its own writes it, in order, stamped with the time it happened.
That thread wakes every WRITE_PERIOD_S rather than at each event (a wake-up per line cost the engine
thread a hand-off of the GIL per line), and writes what queued up meanwhile with one write per handler.
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
WRITE_PERIOD_S = 0.02  # the most a line waits to be written

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
        time.sleep(WRITE_PERIOD_S)
        events, stop = _drain()
        try:
            _emit_all([_record(*event) for event in events])
        except Exception:  # noqa: BLE001 - a log line must never end the thread (later lines would wait)
            logging.getLogger(__name__).exception("%d job events could not be logged", len(events))
        if stop:
            return


def _drain() -> tuple[list[_Event], bool]:
    events: list[_Event] = []
    while True:
        try:
            item = _queue.get_nowait()
        except queue.Empty:
            return events, False
        if item is None:
            return events, True
        events.append(item)


def _record(at: float, event: str, job_id: str, priority: str, fields: dict[str, Any]) -> logging.LogRecord:
    fields = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in fields.items() if v is not None}
    detail = " ".join(f"{k}={v}" for k, v in {"priority": priority, **fields}.items())
    structured = {"event": event, "job_id": job_id, "priority": priority, **fields}
    record = log.makeRecord(
        log.name, logging.INFO, __file__, 0, "job %s %s %s", (event, job_id, detail), None,
        extra={FIELDS_ATTR: structured},
    )  # fmt: skip
    record.created, record.msecs = at, (at - int(at)) * 1000  # when it happened, not when it was written
    return record


def _emit_all(records: list[logging.LogRecord]) -> None:
    """What `log.handle` does for each record, with one write (and flush) per plain stream handler."""
    if not records:
        return
    if log.disabled or log.filters:
        for record in records:
            log.handle(record)
        return
    for handler in _handlers():
        if type(handler) is not logging.StreamHandler or handler.filters:  # e.g. pytest's capture
            for record in records:
                if record.levelno >= handler.level:
                    handler.handle(record)
            continue
        shown = [record for record in records if record.levelno >= handler.level]
        text = "".join(handler.format(record) + handler.terminator for record in shown)
        handler.acquire()
        try:
            handler.stream.write(text)
            handler.flush()
        except Exception:  # noqa: BLE001 - as Handler.handleError would: a log line never breaks its writer
            handler.handleError(records[0])
        finally:
            handler.release()


def _handlers() -> list[logging.Handler]:
    """The handlers a record of `log` reaches (Logger.callHandlers' walk up the hierarchy)."""
    out: list[logging.Handler] = []
    logger: logging.Logger | None = log
    while logger is not None:
        out += logger.handlers
        logger = logger.parent if logger.propagate else None
    return out


atexit.register(flush)
