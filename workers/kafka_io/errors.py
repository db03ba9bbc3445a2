"""Which Kafka client errors are worth retrying."""

from __future__ import annotations

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
