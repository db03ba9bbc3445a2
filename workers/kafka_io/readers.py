"""Readers outside any consumer group: every worker's view of control, and per-job views of a topic."""

from __future__ import annotations

from kafka import KafkaConsumer, TopicPartition

from workers.kafka_io.records import Record, partition_for_key, to_record
from workers.settings import KafkaConnection


class BroadcastReader:
    """Reads every partition of a topic from its end, outside any group: every worker sees every message."""

    def __init__(self, conn: KafkaConnection, topic: str, client_id: str) -> None:
        self._consumer = KafkaConsumer(**conn.client_options(), client_id=client_id, enable_auto_commit=False)
        parts = self._consumer.partitions_for_topic(topic) or {0}
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        self._consumer.assign(tps)
        self._consumer.seek_to_end(*tps)

    def poll(self, timeout_s: float = 0.0) -> list[Record]:
        try:
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000))
        except Exception:  # noqa: BLE001 - a broker hiccup or a bad batch must not stop the worker
            return []
        return [to_record(r) for records in batches.values() for r in records]

    def close(self) -> None:
        self._consumer.close(autocommit=False)


class TopicReader:
    """Reads a topic from a point in time, outside any group; with `key`, only that key's records.

    Used by `tail`, `submit --stream/--wait` and the demo. `since_ms=None` starts at the end.
    """

    def __init__(
        self, conn: KafkaConnection, topic: str, since_ms: int | None, client_id: str, key: str | None = None
    ) -> None:
        self.key = key.encode() if key is not None else None
        self._consumer = KafkaConsumer(**conn.client_options(), client_id=client_id, enable_auto_commit=False)
        parts = sorted(self._consumer.partitions_for_topic(topic) or {0})
        if key is not None:
            parts = [parts[partition_for_key(key, len(parts))]]
        tps = [TopicPartition(topic, p) for p in parts]
        self._consumer.assign(tps)
        found = self._consumer.offsets_for_times({tp: since_ms for tp in tps}) if since_ms is not None else {}
        for tp in tps:
            if found.get(tp) is not None:
                self._consumer.seek(tp, found[tp].offset)
            else:
                self._consumer.seek_to_end(tp)
                self._consumer.position(tp)  # resolve the end now, before anyone writes after it

    def poll(self, timeout_s: float) -> list[Record]:
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000))
        records = (r for rs in batches.values() for r in rs)
        return [to_record(r) for r in records if self.key is None or r.key == self.key]

    def close(self) -> None:
        self._consumer.close(autocommit=False)
