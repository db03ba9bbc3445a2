"""Test-only fault injection, named by `INFERQ_FAILPOINT` (empty in production: every hook is a no-op).

- `crash-before-publish` / `crash-after-publish`: kill -9 this process between a terminal row's commit and
  its result's publish, or between the publish and `published_at` (the outbox's worst moments);
- `step-error`: an engine step raises while it runs a job whose prompt contains "step-error" (a poison
  request);
- `device-fault`: once a step has run a job whose prompt contains "device-fault", every step raises (a
  device that no request will cure).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

log = logging.getLogger(__name__)


def crash_if(failpoint: str, name: str, committed_a_success: bool) -> None:
    if failpoint == name and committed_a_success:
        log.error("failpoint %s: killing this process", name)
        os.kill(os.getpid(), signal.SIGKILL)


def step_fault(failpoint: str, prompt_of: Callable[[str], str]) -> Callable[[tuple[str, ...]], None] | None:
    """The engine's fault hook for these failpoints (None for the others): called with a step's sequences."""
    if failpoint not in ("step-error", "device-fault"):
        return None
    broken = False

    def hook(seq_ids: tuple[str, ...]) -> None:
        nonlocal broken
        if any(failpoint in prompt_of(s) for s in seq_ids):
            broken = failpoint == "device-fault"
            raise RuntimeError(f"failpoint {failpoint}")
        if broken:
            raise RuntimeError("failpoint device-fault (persistent)")

    return hook
