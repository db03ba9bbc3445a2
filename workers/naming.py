"""The names a deployment gives its Kafka group members, defined once: maintenance reads them back.

A deployment is a topic prefix: its workers share one consumer group, and each worker joins it with a
client id that carries its worker id, so bulk maintenance can tell which workers are alive.
"""

from __future__ import annotations

_CLIENT_PREFIX = "inferq-"


def worker_group(topic_prefix: str) -> str:
    """`inferq-workers` for the default prefix: each deployment (prefix) has its own consumer group."""
    return f"{topic_prefix}-workers"


def worker_client_id(worker_id: str) -> str:
    return f"{_CLIENT_PREFIX}{worker_id}"


def live_worker_ids(client_ids: set[str]) -> set[str]:
    """The worker ids behind a group's client ids (others, e.g. tools', are not workers)."""
    return {c.removeprefix(_CLIENT_PREFIX) for c in client_ids if c.startswith(_CLIENT_PREFIX)}
