"""Every token event of a deployment from a point in time: for dashboards, the demo and benchmarks.

`JobClient.stream` follows one job; this reads the whole tokens topic, each event parsed, once per
(tenant, job_id, attempt, seq) even when a producer retry wrote it twice (job ids are per tenant: the
tenant comes from the event's `tenant` header).
"""

from __future__ import annotations

from schemas.jobs import TokenEvent
from workers.kafka_io import TopicReader
from workers.settings import Settings


class TokenEventReader:
    def __init__(
        self, settings: Settings, since_ms: int | None, client_id: str = "inferq-token-events"
    ) -> None:
        self._reader = TopicReader(settings.kafka_connection, settings.topics.tokens, since_ms, client_id)
        self._seen: set[tuple[bytes, str, int, int]] = set()

    def poll(self, timeout_s: float) -> list[TokenEvent]:
        events = []
        for record in self._reader.poll(timeout_s):
            event = TokenEvent.model_validate_json(record.value or b"{}")
            tenant = next((v for k, v in record.headers if k == "tenant"), b"")
            key = (tenant, event.job_id, event.attempt, event.seq)
            if key not in self._seen:
                self._seen.add(key)
                events.append(event)
        return events

    def close(self) -> None:
        self._reader.close()
