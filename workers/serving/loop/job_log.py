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
            _emit_all([_Line(*event) for event in events])
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


class _Line:
    """One event's message and structured fields, and its LogRecord when a handler needs one."""

    __slots__ = ("at", "message", "fields", "_record")

    def __init__(self, at: float, event: str, job_id: str, priority: str, fields: dict[str, Any]) -> None:
        fields = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in fields.items() if v is not None}
        detail = " ".join(f"{k}={v}" for k, v in {"priority": priority, **fields}.items())
        self.at = at
        self.message = f"job {event} {job_id} {detail}"
        self.fields = {"event": event, "job_id": job_id, "priority": priority, **fields}
        self._record: logging.LogRecord | None = None

    @property
    def record(self) -> logging.LogRecord:
        if self._record is None:
            record = log.makeRecord(
                log.name,
                logging.INFO,
                __file__,
                0,
                "%s",
                (self.message,),
                None,
                extra={FIELDS_ATTR: self.fields},
            )
            # when it happened, not when it was written
            record.created, record.msecs = self.at, (self.at - int(self.at)) * 1000
            self._record = record
        return self._record


def _emit_all(lines: list[_Line]) -> None:
    """What `log.handle` does for each line, with one write (and flush) per plain stream handler; inferq's
    own formatters make those lines without a LogRecord (`format_event`): building and formatting a record
    was most of this thread's GIL time, four times a job."""
    if not lines:
        return
    if log.disabled or log.filters:
        for line in lines:
            log.handle(line.record)
        return
    for handler in _handlers():
        if handler.level > logging.INFO:
            continue
        if type(handler) is not logging.StreamHandler or handler.filters:  # e.g. pytest's capture
            for line in lines:
                handler.handle(line.record)
            continue
        fast = getattr(handler.formatter, "format_event", None)
        if fast is not None:
            text = "".join(
                fast(ln.at, "INFO", log.name, ln.message, ln.fields) + handler.terminator for ln in lines
            )
        else:
            text = "".join(handler.format(ln.record) + handler.terminator for ln in lines)
        handler.acquire()
        try:
            handler.stream.write(text)
            handler.flush()
        except Exception:  # noqa: BLE001 - as Handler.handleError would: a log line never breaks its writer
            handler.handleError(lines[0].record)
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
