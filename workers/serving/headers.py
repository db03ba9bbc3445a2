"""Kafka headers on every message of the results and tokens topics: who a message is about, readable
without parsing its JSON (consumers route, filter and deduplicate by them; docs/contract.md)."""

from __future__ import annotations

Headers = list[tuple[str, bytes]]


def job_headers(job_id: str, attempt: int, tenant: str) -> Headers:
    """`job_id`, `attempt` (decimal) and `tenant`, UTF-8."""
    return [("job_id", job_id.encode()), ("attempt", str(attempt).encode()), ("tenant", tenant.encode())]
