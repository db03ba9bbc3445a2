"""A producer, and the handle of one sent message."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError, MessageSizeTooLargeError
from kafka.record.default_records import DefaultRecordBatchBuilder

from workers.kafka_io.admin import max_message_bytes
from workers.settings import KafkaConnection

log = logging.getLogger(__name__)

LIMIT_REFRESH_S = 60.0  # how long a topic's size limit is trusted before it is asked for again


@dataclass(frozen=True)
class Placed:
    """Where the broker stored a message."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int


@dataclass(frozen=True)
class Delivery:
    """A sent message; `wait` blocks until the broker has it (without forcing out everything else)."""

    _future: Any

    def wait(self, timeout_s: float = 30.0) -> Placed:
        """Raises what the client raised (e.g. KafkaTimeoutError) when the broker has not taken it."""
        meta = self._future.get(timeout=timeout_s)
        return Placed(meta.topic, meta.partition, meta.offset, meta.timestamp)

    def settle(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for the outcome; True once the broker answered (see `error`)."""
        with contextlib.suppress(Exception):  # a failure, or still on its way: is_done tells them apart
            self._future.get(timeout=timeout_s)
        return bool(self._future.is_done)

    def on_settled(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call `callback(None)` once the broker has it, or `callback(error)`; on the client's I/O thread."""
        self._future.add_callback(lambda _meta: callback(None))
        self._future.add_errback(callback)

    @property
    def error(self) -> BaseException | None:
        """Why a settled send failed; None if it succeeded."""
        return self._future.exception if self._future.failed() else None


class Producer:
    """Idempotent (kafka-python's default): the client's own retries never write a message twice.

    `max_block_s` bounds how long `send` may wait for buffer space or metadata while the broker is away;
    past it `send` raises, and the caller decides (the worker retries results, drops late token events).

    kafka-python's idempotent producer treats any batch the broker refuses for good (a record over the
    topic's `max.message.bytes`, an invalid record) as fatal: from then on it fails every message, so one
    oversized result would take every later one down with it. Hence, with `check_sizes`, a message larger
    than its topic takes is refused here, before it is sent (MessageSizeTooLargeError, raised by `send`);
    and a client that went fatal anyway (a refusal no check foresaw) is replaced by a new one at the next
    send (the messages it held fail with its error).
    """

    def __init__(
        self,
        conn: KafkaConnection,
        client_id: str,
        linger_ms: int = 5,
        max_block_s: float = 60.0,
        timeout_s: float | None = None,
        check_sizes: bool = False,
    ) -> None:
        """`timeout_s` bounds everything else too: the first connection, each request, and a message's
        delivery (the client gives up on it and its future fails); None keeps the client's defaults."""
        bounds = {}
        if timeout_s is not None:
            ms = max(1000, int(timeout_s * 1000))
            bounds = dict(bootstrap_timeout_ms=ms, request_timeout_ms=ms, delivery_timeout_ms=ms + linger_ms)
        self._conn = conn
        self._options = dict(
            **conn.producer_options(),  # with the batches' compression (INFERQ_KAFKA_COMPRESSION)
            client_id=client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=linger_ms,
            max_block_ms=int(max_block_s * 1000),
            **bounds,
        )
        self._producer = KafkaProducer(**self._options)
        self._check_sizes = check_sizes
        self._limits: dict[str, tuple[float, int | None]] = {}  # topic -> (asked at, max.message.bytes)
        self._lock = threading.Lock()

    def send(
        self,
        topic: str,
        key: str | bytes | None,
        value: bytes,
        headers: Sequence[tuple[str, bytes]] = (),
        check_size: bool | None = None,
    ) -> Delivery:
        """`check_size`: this message's size checked against its topic (None: as the producer was made)."""
        raw_key = key.encode() if isinstance(key, str) else key
        if self._check_sizes if check_size is None else check_size:
            self._check_size(topic, raw_key, value, list(headers))
        return Delivery(self._client().send(topic, value=value, key=raw_key, headers=list(headers) or None))

    def partitions(self, topic: str) -> int:
        """How many partitions the topic has (waits at most max_block_s for the broker to say)."""
        return len(self._client().partitions_for(topic))

    def await_topic(self, topic: str, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the topic's metadata, which its first send needs (a send waits only
        max_block_s for it, a bound meant for a broker that is away); True once it is known."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._client().partitions_for(topic)
                return True
            except KafkaTimeoutError:
                if time.monotonic() >= deadline:
                    return False

    def flush(self, timeout_s: float | None = None) -> None:
        self._producer.flush(timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self._producer.close(timeout=timeout_s)

    def _client(self) -> KafkaProducer:
        """The client, replaced first if it is in a fatal state (it would fail every message from now on)."""
        with self._lock:
            state = getattr(self._producer, "_transaction_manager", None)
            if state is not None and state.has_fatal_error():
                log.warning(
                    "producer %s: the client failed for good (%s); starting a new one",
                    self._options["client_id"],
                    state.last_error,
                )
                old, self._producer = self._producer, KafkaProducer(**self._options)
                old.close(timeout=0)
            return self._producer

    def _check_size(self, topic: str, key: bytes | None, value: bytes, headers: list) -> None:
        limit = self._limit(topic)
        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)  # an upper bound
        if limit is not None and size > limit:
            raise MessageSizeTooLargeError(
                f"the message is up to {size} bytes, more than {topic} takes (max.message.bytes {limit})"
            )

    def _limit(self, topic: str) -> int | None:
        """The topic's limit: asked for before its first message, then refreshed every LIMIT_REFRESH_S on a
        thread of its own (a lookup is a new admin connection: it must not hold up the sends meanwhile)."""
        with self._lock:
            asked, limit = self._limits.get(topic, (None, None))
            if asked is not None:
                if time.monotonic() - asked >= LIMIT_REFRESH_S:
                    self._limits[topic] = (time.monotonic(), limit)  # one refresh at a time
                    refresh = threading.Thread(target=self._ask, args=(topic, limit), daemon=True,
                                               name="inferq-size-limits")  # fmt: skip
                    refresh.start()
                return limit
        return self._ask(topic, None)

    def _ask(self, topic: str, known: int | None) -> int | None:
        limit = known
        try:
            limit = max_message_bytes(self._conn, topic) or known
        except Exception as exc:  # noqa: BLE001 - e.g. no DescribeConfigs permission: keep what was known
            log.debug("could not ask for the size limit of %s: %s", topic, exc)
        with self._lock:
            self._limits[topic] = (time.monotonic(), limit)
        return limit
