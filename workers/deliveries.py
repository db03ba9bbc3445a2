"""Waiting for the broker: sends retried until delivered, and deliveries waited on with a bound."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from workers.kafka_io import Delivery
from workers.retry import Backoff, describe_error, is_transient

log = logging.getLogger(__name__)


class Waitable(Protocol):
    """A message on its way to the broker: `wait` returns once the broker has it, else raises."""

    def wait(self, timeout_s: float = 30.0) -> None: ...


def send_until_delivered(what: str, sends: list[tuple[str, Callable[[], Delivery]]]) -> None:
    """Send every message and wait for the broker; resend only those that did not arrive."""
    backoff = Backoff()
    while sends:
        started = []
        for name, send in sends:
            try:
                started.append((name, send, send()))
            except Exception as exc:  # noqa: BLE001 - e.g. the buffer is full while the broker is away
                started.append((name, send, exc))
        failed, error = [], None
        for name, send, delivery in started:
            try:
                if isinstance(delivery, Exception):
                    raise delivery
                delivery.wait()
            except Exception as exc:  # noqa: BLE001
                if not is_transient(exc):
                    log.error(
                        "%s for job %s can never be sent (%s); dropped", what, name, describe_error(exc)
                    )
                    continue
                failed.append((name, send))
                error = exc
        if failed:
            delay = backoff.next_delay()
            log.warning(
                "%d %s not sent (%s); retrying in %.1fs", len(failed), what, describe_error(error), delay
            )
            time.sleep(delay)
        sends = failed


def await_stream_ends(items: Sequence[object], timeout_s: float) -> None:
    """Wait (bounded in all) for the last token events some items carry; a failure is only logged."""
    deadline = time.monotonic() + timeout_s
    for item in items:
        end = getattr(item, "stream_end", None)
        if end is None:
            continue
        try:
            end.wait(max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - the result must not wait on the stream forever
            log.warning(
                "the last token event of %s was not confirmed: %s", describe_item(item), describe_error(exc)
            )


@dataclass(frozen=True)
class Then:
    """A delivery that runs a callback once the broker has the message."""

    delivery: Delivery
    then: Callable[[], None]

    def wait(self, timeout_s: float = 30.0) -> None:
        self.delivery.wait(timeout_s)
        self.then()


def describe_item(item: object) -> str:
    job_id = getattr(item, "job_id", None) or getattr(getattr(item, "row", None), "job_id", "?")
    return f"{type(item).__name__.lower()} of job {job_id}"
