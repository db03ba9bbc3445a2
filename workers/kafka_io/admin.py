"""Consumer-group look-ups through the admin client."""

from __future__ import annotations

from kafka import KafkaAdminClient
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
