"""Log output of the long-running commands (`worker`, `bulk-worker`, `run-batch`): text for people, or one
JSON object per line for log collectors (Loki, Elasticsearch, CloudWatch) that index fields.

A JSON line always has time (UTC, ISO 8601), level, logger, message and worker_id; per-job events
(workers/serving/loop/job_log.py) add job_id, priority, event and their own fields.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import UTC, datetime
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FIELDS_ATTR = "inferq"  # the LogRecord attribute holding an event's structured fields
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def __init__(self, worker_id: str) -> None:
        super().__init__()
        self.worker_id = worker_id

    def format(self, record: logging.LogRecord) -> str:
        doc = self._doc(record.created, record.levelname, record.name, record.getMessage())
        doc.update(getattr(record, FIELDS_ATTR, None) or {})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, default=str)

    def format_event(self, at: float, level: str, logger: str, message: str, fields: dict[str, Any]) -> str:
        """The line `format` makes of a record with these values, made without one (see EventFormatter)."""
        return json.dumps(
            {**self._doc(at, level, logger, message), **fields}, ensure_ascii=False, default=str
        )

    def _doc(self, at: float, level: str, logger: str, message: str) -> dict[str, Any]:
        return {
            "time": datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds"),
            "level": level,
            "logger": logger,
            "message": message,
            "worker_id": self.worker_id,
        }


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT, and the same line straight from an event's values (`format_event`, as JsonFormatter's)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._second: tuple[int, str] = (-1, "")  # the last second formatted, and its text

    def format_event(self, at: float, level: str, logger: str, message: str, fields: dict[str, Any]) -> str:
        second = int(at)
        if second != self._second[0]:  # formatTime's text for this second, once a second
            self._second = (second, time.strftime(self.default_time_format, self.converter(at)))
        stamp = self.default_msec_format % (self._second[1], (at - second) * 1000)
        return f"{stamp} {level} {logger}: {message}"


def formatter(log_format: str, worker_id: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(worker_id)
    if log_format == "text":
        return TextFormatter()
    raise ValueError(f"log format {log_format!r}; use one of {LOG_FORMATS}")


def configure(level: str, log_format: str, worker_id: str, stream: TextIO | None = None) -> None:
    """One handler on the root logger (replacing any), in the chosen format; kafka-python's chatter off."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(log_format, worker_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("kafka").setLevel(logging.WARNING)
    logging.captureWarnings(True)  # Python warnings become log records (of logger py.warnings), not raw text


def current() -> tuple[str, str]:
    """(level, format) of the root logger as `configure` set it: for child processes to log alike."""
    root = logging.getLogger()
    json_out = any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    return logging.getLevelName(root.level), "json" if json_out else "text"
