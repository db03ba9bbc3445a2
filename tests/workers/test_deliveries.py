"""`Deliveries`: a message is resent only when it is known not to be in the topic (pure logic, fake sends)."""

from __future__ import annotations

from collections import Counter

import pytest
from kafka.errors import KafkaConnectionError, MessageSizeTooLargeError, TopicAuthorizationFailedError

import workers.serving.outbox.delivery as deliveries
from workers.serving.outbox.delivery import Deliveries, Ledger


class Settled:
    """A send the broker has answered: `error` None for success."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def settle(self, timeout_s: float) -> bool:
        return True


class Topic:
    """Fake sends and a fake topic: each name's sends answer in turn from `outcomes` (then succeed);
    a failed send may still have been written (`written_anyway`), as with a lost acknowledgement."""

    def __init__(self, outcomes: dict[str, list[BaseException]], written_anyway: set[str] = frozenset()):
        self.outcomes = {name: list(errors) for name, errors in outcomes.items()}
        self.written_anyway = set(written_anyway)
        self.sent: Counter[str] = Counter()
        self.messages: Counter[str] = Counter()  # what the topic holds
        self.lookups: list[list[str]] = []
        self.lookup_failures = 0

    def send(self, name: str) -> Settled:
        self.sent[name] += 1
        errors = self.outcomes.get(name, [])
        error = errors.pop(0) if errors else None
        if error is None or name in self.written_anyway:
            self.messages[name] += 1
        return Settled(error)

    def sends(self, names) -> dict:
        return {name: lambda n=name: self.send(n) for name in names}

    def landed(self, names: list[str]) -> set[str]:
        self.lookups.append(names)
        if self.lookup_failures:
            self.lookup_failures -= 1
            raise KafkaConnectionError("broker away")
        return {n for n in names if self.messages[n]}


class Sender(Ledger):
    """The sender's side: which messages stay its own (`keep`), what it heard delivered, and the
    replacement of a message the broker refused (`refused`)."""

    def __init__(self, keep=None, refused=None) -> None:
        self.keep, self.refused = keep, refused
        self.heard: list[str] = []

    def ours(self, names):
        return self.keep(names) if self.keep is not None else set(names)

    def delivered(self, names) -> None:
        self.heard.extend(names)

    def replacement(self, name, exc):
        return self.refused(name, exc) if self.refused is not None else None


class RefusedLookup:
    """A lookup the broker refuses (no READ on the topic)."""

    def __init__(self, topic: Topic) -> None:
        self.topic = topic

    def landed(self, names):
        self.topic.lookups.append(names)
        raise TopicAuthorizationFailedError("no READ on the results topic")


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    monkeypatch.setattr(deliveries.time, "sleep", lambda s: None)


def test_a_send_that_failed_but_was_written_is_not_sent_again():
    topic = Topic({"a": [KafkaConnectionError("lost")], "b": [KafkaConnectionError("lost")]}, {"a"})
    sender = Sender()
    Deliveries("results", sender, topic).send(topic.sends("abc"))
    assert topic.messages == Counter({"a": 1, "b": 1, "c": 1})  # each exactly once
    assert topic.sent == Counter({"a": 1, "b": 2, "c": 1})
    assert sorted(sender.heard) == ["a", "b", "c"]
    assert topic.lookups == [["a", "b"]]


def test_nothing_doubtful_is_sent_while_the_lookup_fails():
    topic = Topic({"a": [KafkaConnectionError("lost")]})
    topic.lookup_failures = 3
    Deliveries("results", lookup=topic).send(topic.sends("a"))
    assert topic.sent["a"] == 2 and topic.messages["a"] == 1
    assert len(topic.lookups) == 4  # three failures, then the answer "not there": sent once more


def test_unsure_messages_are_looked_for_before_their_first_send():
    topic = Topic({})
    topic.messages["published-by-a-dead-worker"] = 1
    sender = Sender()
    names = ["published-by-a-dead-worker", "never-sent"]
    Deliveries("results", sender, topic).send(topic.sends(names), unsure=names)
    assert topic.sent == Counter({"never-sent": 1})
    assert sorted(sender.heard) == sorted(names)


def test_without_a_lookup_a_failed_send_is_resent():
    topic = Topic({"a": [KafkaConnectionError("lost")]}, {"a"})
    Deliveries("results").send(topic.sends("a"))
    assert topic.messages["a"] == 2  # the duplicate the lookup exists to prevent


def test_a_message_the_broker_never_takes_is_given_up_not_retried():
    topic = Topic({"a": [MessageSizeTooLargeError("too big")]})
    sender = Sender()
    given_up = Deliveries("results", sender, topic).send(topic.sends("ab"))
    assert topic.sent == Counter({"a": 1, "b": 1}) and sender.heard == ["b"]
    assert topic.lookups == [] and given_up == {"a"}


def test_a_refused_message_can_be_replaced_and_a_refused_replacement_is_given_up():
    topic = Topic({"a": [MessageSizeTooLargeError("too big")], "b": [MessageSizeTooLargeError("too big")],
                   "b-small": [MessageSizeTooLargeError("still too big")]})  # fmt: skip
    offered: list[tuple[str, str]] = []

    def refused(name, exc):
        offered.append((name, type(exc).__name__))
        if len([n for n, _ in offered if n == name]) > 1:
            return None  # the replacement was refused too: nothing smaller
        return lambda: topic.send(f"{name}-small")

    sender = Sender(refused=refused)
    given_up = Deliveries("results", sender).send(topic.sends("abc"))
    assert sorted(sender.heard) == ["a", "c"] and given_up == {"b"}
    assert topic.messages == Counter({"a-small": 1, "c": 1})
    assert sorted(name for name, _ in offered) == ["a", "b", "b"]
    assert {error for _, error in offered} == {"MessageSizeTooLargeError"}


def test_what_is_left_at_the_deadline_is_neither_delivered_nor_given_up():
    topic = Topic({"a": [KafkaConnectionError("away")] * 100})
    sender = Sender()
    given_up = Deliveries("results", sender).send(topic.sends("a"), until=0.0)
    assert sender.heard == [] and given_up == set() and topic.sent["a"] == 0


def test_a_message_no_longer_ours_is_neither_looked_for_nor_sent():
    topic = Topic({"a": [KafkaConnectionError("lost")]})
    rounds = iter([{"a"}, set()])
    Deliveries("results", Sender(keep=lambda names: next(rounds)), topic).send(topic.sends("a"))
    assert topic.sent["a"] == 1 and topic.lookups == []


def test_a_lookup_that_keeps_failing_gives_way_to_a_resend():
    topic = Topic({"a": [KafkaConnectionError("lost")]})
    topic.lookup_failures = 100
    Deliveries("results", lookup=topic).send(topic.sends("a"))
    assert len(topic.lookups) == deliveries.LOOKUP_TRIES
    assert topic.sent["a"] == 2  # at least once: sent again, a second copy possible


def test_a_lookup_the_broker_refuses_is_not_retried():
    topic = Topic({"a": [KafkaConnectionError("lost")]})
    Deliveries("results", lookup=RefusedLookup(topic)).send(topic.sends("a"))
    assert len(topic.lookups) == 1 and topic.sent["a"] == 2


def test_leases_are_checked_again_after_a_lookup():
    topic = Topic({"a": [KafkaConnectionError("lost")]})
    calls: list[list[str]] = []

    def keep(names):
        calls.append(names)
        return set(names) if len(calls) < 3 else set()  # the lease lapsed while the lookup ran

    Deliveries("results", Sender(keep=keep), topic).send(topic.sends("a"))
    assert topic.sent["a"] == 1 and len(topic.lookups) == 1 and len(calls) == 3
