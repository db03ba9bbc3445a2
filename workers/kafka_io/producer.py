"""A producer, and the handle of one sent message."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kafka import KafkaProducer

from workers.settings import KafkaConnection


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
    """

    def __init__(
        self,
        conn: KafkaConnection,
        client_id: str,
        linger_ms: int = 5,
        max_block_s: float = 60.0,
        timeout_s: float | None = None,
    ) -> None:
        """`timeout_s` bounds everything else too: the first connection, each request, and a message's
        delivery (the client gives up on it and its future fails); None keeps the client's defaults."""
        bounds = {}
        if timeout_s is not None:
            ms = max(1000, int(timeout_s * 1000))
            bounds = dict(bootstrap_timeout_ms=ms, request_timeout_ms=ms, delivery_timeout_ms=ms + linger_ms)
        self._producer = KafkaProducer(
            **conn.producer_options(),  # with the batches' compression (INFERQ_KAFKA_COMPRESSION)
            client_id=client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=linger_ms,
            max_block_ms=int(max_block_s * 1000),
            **bounds,
        )

    def send(
        self, topic: str, key: str | bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]] = ()
    ) -> Delivery:
        raw_key = key.encode() if isinstance(key, str) else key
        return Delivery(self._producer.send(topic, value=value, key=raw_key, headers=list(headers) or None))

    def partitions(self, topic: str) -> int:
        """How many partitions the topic has (waits at most max_block_s for the broker to say)."""
        return len(self._producer.partitions_for(topic))

    def flush(self, timeout_s: float | None = None) -> None:
        self._producer.flush(timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self._producer.close(timeout=timeout_s)
