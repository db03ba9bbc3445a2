"""Test-only fault injection, named by `INFERQ_FAILPOINT` (empty in production: every hook is a no-op).

- `crash-before-publish` / `crash-after-publish`: kill -9 this process between a terminal row's commit and
  its result's publish, or between the publish and `published_at` (the outbox's worst moments);
- `step-error`: an engine step raises while it holds a job whose prompt contains "step-error".
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable

from schemas.jobs import JobRequest

log = logging.getLogger(__name__)


def crash_if(failpoint: str, name: str, committed_a_success: bool) -> None:
    if failpoint == name and committed_a_success:
        log.error("failpoint %s: killing this process", name)
        os.kill(os.getpid(), signal.SIGKILL)


def step_error_if(failpoint: str, requests: Iterable[JobRequest]) -> None:
    if failpoint == "step-error" and any("step-error" in (r.prompt or "") for r in requests):
        raise RuntimeError("failpoint step-error")
