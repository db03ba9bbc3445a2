"""Waiting for the broker: sends retried until delivered, and deliveries waited on with a bound."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Protocol

from workers.kafka_io.errors import kafka_refused
from workers.serving.errors import Backoff, describe_error, is_transient

log = logging.getLogger(__name__)

Name = Hashable  # what names a message in a delivery (a job's (tenant, job_id), a dead letter's label)


class Waitable(Protocol):
    """A message on its way to the broker: `wait` returns once the broker has it, else raises."""

    def wait(self, timeout_s: float = 30.0) -> None: ...


class Delivery(Protocol):
    """A message on its way to the broker: `settle` waits (bounded) for its outcome, `error` says it
    (kafka_io.Delivery in-process, the relay's handle for a message it sends)."""

    def settle(self, timeout_s: float) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...


class MessageSender(Protocol):
    """What sends results: kafka_io.Producer, or the relay's producer (streaming.sender.RelayProducer)."""

    def send(
        self, topic: str, key: str | bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]] = ()
    ) -> Delivery: ...


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


class Ledger:
    """What the sender of a delivery keeps about its messages, asked by `Deliveries` as it goes. This base
    keeps nothing: every message stays its sender's to send, and one the broker refuses is given up."""

    def ours(self, names: list[Name]) -> set[Name]:
        """Before each round: which messages are still this sender's to send (e.g. a publish lease it
        renews); the others are dropped unsent (taken over, or done by someone else)."""
        return set(names)

    def delivered(self, names: list[Name]) -> None:
        """After each round: the messages the broker has now."""

    def replacement(self, name: Name, exc: BaseException) -> Callable[[], Delivery] | None:
        """A message the broker can never take (too large, invalid): the send of a message that takes its
        place (e.g. a smaller form of it), or None to give it up."""
        return None


class Lookup(Protocol):
    """Which of these names already have their message in the topic (raises when the broker cannot say)."""

    def landed(self, names: list[Name]) -> set[Name]: ...


class Deliveries:
    """Sends every message and waits for the broker; resends only those that failed.

    A message still on its way is never sent again (a second copy could land after the first). Transient
    failures retry with backoff for as long as it takes (or until a deadline, when given: what is left
    then is neither delivered nor refused). The `ledger` hears how it goes (see Ledger).

    With a `lookup`, a message that may have reached the broker is looked for before it is sent again:
    one whose send failed after it left (the broker may have written it and lost only its answer), and
    those named unsure (e.g. a result another worker may have published before it died). One found there
    counts as delivered; while the lookup fails, nothing doubtful is sent (see _Doubts).
    """

    def __init__(
        self, what: str, ledger: Ledger | None = None, lookup: Lookup | None = None, round_s: float = 5.0
    ) -> None:
        self.what = what  # what the messages are, for the log: "results", "dead-lettered records"
        self.ledger = ledger if ledger is not None else Ledger()
        self.lookup = lookup
        self.round_s = round_s  # the longest wait for the broker's answers before a round ends

    def send(
        self,
        sends: dict[Name, Callable[[], Delivery]],
        unsure: Iterable[Name] = (),
        until: float | None = None,
    ) -> set[Name]:
        """Deliver each named message (`sends` makes its send); the names whose message the broker refused
        for good (their senders must not count them as delivered). `until`: a monotonic deadline."""
        what, ledger = self.what, self.ledger
        landed = self.lookup.landed if self.lookup is not None else None
        pending, on_way = dict(sends), {}
        doubts = _Doubts(what, landed, set(unsure) & set(sends))
        backoff = Backoff()
        given_up: set[Name] = set()
        replaced: list[Name] = []  # this round's replacements: sent next round without a backoff

        def keep_ours() -> None:
            ours = ledger.ours(list(pending))
            for name in [n for n in pending if n not in ours]:  # taken over (our lease lapsed) or done
                pending.pop(name)
                on_way.pop(name, None)

        def never(name: Name, exc: BaseException) -> None:
            """The broker will never take this message: replace it, or give it up."""
            replacement = ledger.replacement(name, exc)
            if replacement is not None:
                error = describe_error(exc)
                log.warning("%s for job %s refused (%s); sending a replacement", what, name, error)
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
                    except Exception as exc:  # noqa: BLE001 - e.g. the buffer is full, the broker away
                        if not is_transient(exc):
                            never(name, exc)
                        error = exc
            deadline = time.monotonic() + self.round_s
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
                ledger.delivered(done)
                backoff.reset()
            elif replaced:
                replaced.clear()
            elif pending and not on_way:
                delay = backoff.next_delay()
                reason = describe_error(error) if error else "no answer"
                log.warning("%d %s not sent (%s); retrying in %.1fs", len(pending), what, reason, delay)
                time.sleep(delay)
        return given_up
