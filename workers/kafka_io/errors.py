"""Which Kafka client errors are worth retrying."""

from __future__ import annotations

import builtins

import kafka.errors
from kafka.errors import (
    AuthorizationError,
    InvalidRecordError,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    UnsupportedVersionError,
)

# records the broker will never take, however often they are sent
_TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError)
_NEVER = (*_TOO_LARGE, InvalidRecordError, InvalidTopicError)


def kafka_transient(exc: BaseException) -> bool | None:
    """True for a broker that is away (timeouts, connections, no leader), False for a record it refuses;
    None when `exc` is no Kafka client error."""
    if not isinstance(exc, KafkaError):
        return None
    return not isinstance(exc, _NEVER)


def kafka_refused(exc: BaseException) -> bool:
    """A request the broker will not serve this client until someone changes its setup (ACLs, versions)."""
    return isinstance(exc, AuthorizationError | UnsupportedVersionError)


def kafka_too_large(exc: BaseException) -> bool:
    """A record larger than the producer or the topic (`max.message.bytes`) accepts: a smaller one may go."""
    return isinstance(exc, _TOO_LARGE)


def error_named(name: str, why: str) -> BaseException:
    """The error of a class named `name` (the Kafka client's, or a built-in one such as TimeoutError), as
    another process raised it: so a failure told across a pipe is retried, or not, as it would be here.
    An unknown name gives a RuntimeError: never taken for transient."""
    kind = getattr(kafka.errors, name, None) or getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(why)
        except Exception:  # noqa: BLE001 - a class that wants other arguments
            pass
    return RuntimeError(f"{name}: {why}" if why else name)
