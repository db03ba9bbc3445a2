"""Batch lifecycle events to Kafka (`<prefix>.batches`, key = batch id), so producers need not poll.

Value: `{"type": "batch.completed" | "batch.failed" | "batch.expired" | "batch.cancelled", "batch": {...}}`
with the Batch object as GET /v1/batches/{id} returns it. At least once: the batch driver marks a batch's
event published only after the broker has it, and sends it again otherwise (an API process died between).
"""

from __future__ import annotations

import json
from typing import Any

from workers.kafka_io import Producer
from workers.kafka_io.admin import ensure_topics
from workers.settings import Settings

EVENT_TYPES = {s: f"batch.{s}" for s in ("completed", "failed", "expired", "cancelled")}


class BatchEvents:
    def __init__(self, settings: Settings, timeout_s: float = 10.0) -> None:
        self.topic = settings.topics.batches
        self.timeout_s = timeout_s
        ensure_topics(settings.kafka_connection, {self.topic: 1}, settings.replication_factor)
        self._producer = Producer(
            settings.kafka_connection, "inferq-api-events", linger_ms=0, timeout_s=timeout_s
        )

    def publish(self, batch: dict[str, Any]) -> None:
        """Returns once the broker has the event; raises otherwise."""
        value = json.dumps({"type": EVENT_TYPES[batch["status"]], "batch": batch}).encode()
        self._producer.send(self.topic, batch["id"], value).wait(self.timeout_s)

    def close(self) -> None:
        self._producer.close(self.timeout_s)
