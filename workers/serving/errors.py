"""Which failures are worth retrying, and how long to wait before the next try.

Transient: the service is away or busy (connection lost or refused, timeouts, serialization failures,
deadlocks, a broker that is down). Everything else is about the data itself (a value PostgreSQL refuses,
a constraint): retrying it would wedge the caller forever, so it is split off and reported instead.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from workers.db.errors import db_transient
from workers.kafka_io.errors import kafka_transient

log = logging.getLogger(__name__)
T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    if db_transient(exc):
        return True
    kafka = kafka_transient(exc)
    if kafka is not None:
        return kafka
    return isinstance(exc, TimeoutError | ConnectionError)


@dataclass
class Backoff:
    """Exponential backoff with full jitter: base, 2·base, 4·base … up to cap, each scaled by U(0.5, 1)."""

    base_s: float = 0.1
    cap_s: float = 5.0
    failures: int = 0

    def next_delay(self) -> float:
        delay = min(self.cap_s, self.base_s * 2**self.failures)
        self.failures = min(self.failures + 1, 30)
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.failures = 0


def describe_error(exc: BaseException) -> str:
    """One line about an error, never a statement's parameters (prompts and outputs stay out of logs)."""
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def retry_transient(work: Callable[[], T], what: str, backoff: Backoff | None = None) -> T:
    """Run `work`, retrying transient failures with jittered backoff; any other failure is raised."""
    backoff = backoff or Backoff()
    while True:
        try:
            return work()
        except Exception as exc:
            if not is_transient(exc):
                raise
            delay = backoff.next_delay()
            log.warning("%s failed (%s); retrying in %.1fs", what, describe_error(exc), delay)
            time.sleep(delay)


def until_available(build: Callable[[], T], what: str) -> T:
    """`build()` until the service is there: a worker started while its broker is away waits for it (as it
    rides through an outage later) instead of exiting. Refused credentials and the like raise at once."""
    return retry_transient(build, f"connecting to {what}", Backoff(base_s=0.5, cap_s=15.0))
