"""The admin client: broker health, topics, and consumer-group look-ups."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from kafka import KafkaAdminClient
from kafka.admin import ConfigResource
from kafka.errors import KafkaError

from workers.settings import KafkaConnection


def group_client_ids(conn: KafkaConnection, group_id: str) -> set[str]:
    """client_ids of a consumer group's live members (bulk maintenance uses it to find dead workers)."""
    admin = KafkaAdminClient(**conn.client_options(), client_id="inferq-admin")
    try:
        group = admin.describe_groups([group_id])[group_id]
    finally:
        admin.close()
    if group.get("error"):
        raise KafkaError(group["error"])
    return {member["client_id"] for member in group.get("members", [])}


def group_members(conn: KafkaConnection, group: str) -> int:
    """Members of a consumer group once it is stable (0 while it rebalances or does not exist)."""
    with KafkaAdminClient(**conn.client_options(), client_id="inferq-admin") as admin:
        try:
            info = admin.describe_groups([group]).get(group, {})
        except KafkaError:  # e.g. a new broker whose group coordinator is not up yet
            return 0
    state = info.get("group_state") or info.get("state")
    return len(info.get("members", [])) if state == "Stable" else 0


def ping(conn: KafkaConnection, timeout_ms: int = 2000) -> bool:
    """True when the broker answers a metadata request with itself registered."""
    if not _port_open(conn.bootstrap):
        return False  # refused at once: skip the client's bootstrap timeout
    try:
        options = conn.client_options() | {"reconnect_backoff_max_ms": 200}
        admin = KafkaAdminClient(
            **options, bootstrap_timeout_ms=timeout_ms, request_timeout_ms=timeout_ms, client_id="inferq-ping"
        )
    except Exception:
        return False
    try:
        return bool(admin.describe_cluster().get("brokers"))
    except Exception:
        return False
    finally:
        admin.close()


def ensure_topics(
    conn: KafkaConnection, partitions: dict[str, int], replication_factor: int = 1, grow: bool = False
) -> list[str]:
    """Create missing topics; return what changed, and what was left alone that differs, for the log.

    An existing topic with fewer partitions than configured is grown only with `grow`: Kafka places a key
    by the partition count, so growing moves keys to other partitions, breaking per-job order and the
    key-to-partition look-ups of running workers and clients (a job's records and its result or tokens
    would be split across two partitions). Without `grow` such a topic is reported and left as it is.
    """
    with KafkaAdminClient(**conn.client_options(), client_id="inferq-up") as admin:
        existing = {t["name"]: len(t["partitions"]) for t in admin.describe_topics()}
        missing = {t: n for t, n in partitions.items() if t not in existing}
        fewer = {t: n for t, n in partitions.items() if t in existing and existing[t] < n}
        if missing:
            spec = {
                t: {"num_partitions": n, "replication_factor": replication_factor} for t, n in missing.items()
            }
            admin.create_topics(spec, wait_for_metadata=True)
        if fewer and grow:
            admin.create_partitions(fewer)
    lines = [f"created {t} ({n} partitions)" for t, n in missing.items()]
    if grow:
        return lines + [f"grew {t} from {existing[t]} to {n} partitions" for t, n in fewer.items()]
    return lines + [
        f"warning: {t} has {existing[t]} partitions, {n} configured; left as it is (growing it moves "
        "keys to other partitions: `inferq up --grow-partitions` does it)"
        for t, n in fewer.items()
    ]


def max_message_bytes(conn: KafkaConnection, topic: str, timeout_s: float = 5.0) -> int | None:
    """The largest record batch the topic takes (`max.message.bytes`); None when the broker does not say."""
    ms = max(1000, int(timeout_s * 1000))
    options = dict(bootstrap_timeout_ms=ms, request_timeout_ms=ms, client_id="inferq-limits")
    with KafkaAdminClient(**conn.client_options(), **options) as admin:
        found = admin.describe_configs(
            [ConfigResource("TOPIC", topic, ["max.message.bytes"])], config_filter="all"
        )
    value = found.get("topic", {}).get(topic, {}).get("max.message.bytes", {}).get("value")
    return int(value) if value is not None else None


def topic_records(conn: KafkaConnection, topic: str) -> int:
    """Records ever written to a topic: its partitions' end offsets, summed (a benchmark's event count)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(**conn.client_options(), client_id="inferq-admin")
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        return sum(consumer.end_offsets([TopicPartition(topic, p) for p in parts]).values())
    finally:
        consumer.close()


def delete_topics(conn: KafkaConnection, prefix: str) -> list[str]:
    """Delete the topics of one deployment (named `<prefix>.…`), e.g. a benchmark's private ones."""
    with KafkaAdminClient(**conn.client_options(), client_id="inferq-admin") as admin:
        ours = [t for t in admin.list_topics() if t.startswith(prefix + ".")]
        if ours:
            admin.delete_topics(ours)
    return ours


def wait_for_members(
    conn: KafkaConnection,
    group: str,
    count: int,
    timeout_s: float,
    alive: Callable[[], None] | None = None,
    at_least: bool = False,
) -> None:
    """Until the group is stable with `count` members (or at least that many), polling every 0.5 s.

    `alive` is called between polls and may raise, e.g. when the worker being waited for has exited.
    Raises TimeoutError when the group does not get there in time.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        members = group_members(conn, group)
        if members == count or (at_least and members >= count):
            return
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"group {group} did not have {count} stable members within {timeout_s:.0f}s")
        time.sleep(0.5)


def _port_open(bootstrap: str) -> bool:
    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
    except (OSError, ValueError):
        return False
    return True
