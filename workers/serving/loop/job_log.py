"""Per-job events in the logs: one INFO line each, with structured fields for JSON logs.

The vocabulary: admitted (handed to the engine), started (first scheduled), first_token, finished (with
status and timings), rejected (with reason). Fields are ids, counts, timings and reasons: never a prompt
or an output.
"""

from __future__ import annotations

import logging
from typing import Any

from workers.logs import FIELDS_ATTR

log = logging.getLogger("inferq.jobs")

EVENTS = ("admitted", "started", "first_token", "finished", "rejected")


def job_event(event: str, job_id: str, priority: str, **fields: Any) -> None:
    """Log `event` of a job; fields that are None are left out."""
    if not log.isEnabledFor(logging.INFO):
        return
    fields = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in fields.items() if v is not None}
    detail = " ".join(f"{k}={v}" for k, v in {"priority": priority, **fields}.items())
    structured = {"event": event, "job_id": job_id, "priority": priority, **fields}
    log.info("job %s %s %s", event, job_id, detail, extra={FIELDS_ATTR: structured})
