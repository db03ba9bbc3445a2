"""Waiting for the broker: sends retried until delivered, and deliveries waited on with a bound."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol

from workers.kafka_io import Delivery
from workers.kafka_io.errors import kafka_refused
from workers.serving.errors import Backoff, describe_error, is_transient

log = logging.getLogger(__name__)

Name = Hashable  # what names a message in a delivery (a job's (tenant, job_id), a dead letter's label)


class Waitable(Protocol):
    """A message on its way to the broker: `wait` returns once the broker has it, else raises."""

    def wait(self, timeout_s: float = 30.0) -> None: ...


LOOKUP_TRIES = 4  # failed lookups in a row before doubtful messages are sent anyway (at least once)


class _Doubts:
    """Messages that may be in the topic already, and the lookups that settle them."""

    def __init__(self, what: str, landed: Callable[[list[Name]], set[Name]] | None, names: set[Name]) -> None:
        self.what = what
        self.landed = landed
        self.names = names if landed is not None else set()
        self.failures = 0

    def add(self, name: Name) -> None:
        if self.landed is not None:
            self.names.add(name)

    def settle(self, pending: dict) -> tuple[list[Name], BaseException | None]:
        """Look for the doubtful messages still pending: (those found, the lookup's error if it failed).

        A lookup that fails for a reason other than an absent broker, or fails LOOKUP_TRIES times in a
        row, stops the looking: the messages are then sent again (a second copy is possible).
        """
        self.names &= set(pending)
        if not self.names or self.landed is None:
            return [], None
        try:
            found = self.landed(sorted(self.names))
        except Exception as exc:  # noqa: BLE001 - the broker cannot say now: send none of them yet
            self.failures += 1
            if not is_transient(exc) or kafka_refused(exc) or self.failures >= LOOKUP_TRIES:
                log.error(
                    "could not look for %d %s already sent (%s); sending them again",
                    len(self.names),
                    self.what,
                    describe_error(exc),
                )
                self.names.clear()
            return [], exc
        self.failures = 0
        done = [name for name in self.names if name in found]
        if done:
            log.info("%d %s already in the topic: not sent again", len(done), self.what)
        self.names.clear()
        return done, None


def deliver(
    what: str,
    sends: dict[Name, Callable[[], Delivery]],
    keep: Callable[[list[Name]], set[Name]] | None = None,
    delivered: Callable[[list[Name]], None] = lambda names: None,
    round_s: float = 5.0,
    landed: Callable[[list[Name]], set[Name]] | None = None,
    unsure: Iterable[Name] = (),
    refused: Callable[[Name, BaseException], Callable[[], Delivery] | None] | None = None,
    until: float | None = None,
) -> set[Name]:
    """Send every message and wait for the broker; resend only those that failed. Returns the names
    whose message the broker refused for good (their senders must not count them as delivered).

    A message still on its way is never sent again (a second copy could land after the first).
    Before each round, `keep` says which messages are still this worker's to send (a publish lease it
    renews); after each round, `delivered` hears which ones the broker has. Transient failures retry
    with backoff for as long as it takes (or until the monotonic time `until`, when given: what is left
    then is neither delivered nor refused). A message the broker can never take (too large, invalid) is
    offered to `refused`, which may return a send of a replacement message (e.g. a smaller form of it)
    that takes its place; without one the message is logged and given up.

    With `landed` (which of these names already have their message in the topic; raises when the broker
    cannot say), a message that may have reached the broker is looked for before it is sent again: one
    whose send failed after it left (the broker may have written it and lost only its answer), and
    those named in `unsure` (e.g. a result another worker may have published before it died). One
    found there counts as delivered; while the lookup fails, nothing doubtful is sent (see _Doubts).
    """
    pending, on_way = dict(sends), {}
    doubts = _Doubts(what, landed, set(unsure) & set(sends))
    backoff = Backoff()
    given_up: set[Name] = set()
    replaced: list[Name] = []  # this round's replacements: sent next round without a backoff

    def keep_ours() -> None:
        if keep is not None:
            ours = keep(list(pending))
            for name in [n for n in pending if n not in ours]:  # taken over (our lease lapsed) or done
                pending.pop(name)
                on_way.pop(name, None)

    def never(name: Name, exc: BaseException) -> None:
        """The broker will never take this message: replace it, or give it up."""
        replacement = refused(name, exc) if refused is not None else None
        if replacement is not None:
            log.warning("%s for job %s refused (%s); sending a replacement", what, name, describe_error(exc))
            pending[name] = replacement
            replaced.append(name)
            return
        log.error("%s for job %s can never be sent (%s); given up", what, name, describe_error(exc))
        pending.pop(name)
        given_up.add(name)

    while pending:
        if until is not None and time.monotonic() >= until:
            log.info("%d %s not sent in the time given; left for later", len(pending), what)
            break
        keep_ours()
        looked = bool(doubts.names & set(pending))
        done, error = doubts.settle(pending)
        for name in done:
            pending.pop(name)
        if looked and pending:
            keep_ours()  # a lookup can take seconds: send only what is still ours after it
        for name, send in list(pending.items()):
            if name not in on_way and name not in doubts.names:
                try:
                    on_way[name] = send()
                except Exception as exc:  # noqa: BLE001 - e.g. the buffer is full while the broker is away
                    if not is_transient(exc):
                        never(name, exc)
                    error = exc
        deadline = time.monotonic() + round_s
        for name, delivery in list(on_way.items()):
            if not delivery.settle(max(0.0, deadline - time.monotonic())):
                continue  # still on its way: wait for it next round, never send it twice
            del on_way[name]
            if delivery.error is None:
                done.append(name)
                pending.pop(name)
            elif is_transient(delivery.error):
                error = delivery.error
                doubts.add(name)
            else:
                never(name, delivery.error)
        if done:
            delivered(done)
            backoff.reset()
        elif replaced:
            replaced.clear()
        elif pending and not on_way:
            delay = backoff.next_delay()
            reason = describe_error(error) if error else "no answer"
            log.warning("%d %s not sent (%s); retrying in %.1fs", len(pending), what, reason, delay)
            time.sleep(delay)
    return given_up
