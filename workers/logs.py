"""Log output of the long-running commands (`worker`, `bulk-worker`, `run-batch`): text for people, or one
JSON object per line for log collectors (Loki, Elasticsearch, CloudWatch) that index fields.

A JSON line always has time (UTC, ISO 8601), level, logger, message and worker_id; per-job events
(workers/serving/loop/job_log.py) add job_id, priority, event and their own fields.
"""

from __future__ import annotations

import json
import logging
import sys
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
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "worker_id": self.worker_id,
        }
        doc.update(getattr(record, FIELDS_ATTR, None) or {})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


def formatter(log_format: str, worker_id: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(worker_id)
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
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
