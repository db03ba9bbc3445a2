"""Where a job's TTFT went, from the worker's own timestamps in the `jobs` table (read-only).

`created_at` is the Kafka record's timestamp (set by the client's producer on this host), `queued_at` when the
worker admitted it, `first_token_at` when the engine produced its first token. So, per job:
  intake   = queued_at - created_at        (Kafka delivery + the worker getting round to poll)
  schedule = first_token_at - queued_at    (admission row, waiting in the engine, the first step(s))
  emit     = client TTFT - (first_token_at - created_at)   (coalescing, producer, Kafka, the client's reader)
"""

from __future__ import annotations

import time

from bench.e2e.stats import JobTrace, percentile, ttft_ms


def ttft_breakdown(database_url: str, traces: list[JobTrace], wait_s: float = 5.0) -> dict[str, float | None]:
    from sqlalchemy import create_engine, select

    from schemas.tables import jobs

    ids = [t.job_id for t in traces]
    query = select(jobs.c.job_id, jobs.c.created_at, jobs.c.queued_at, jobs.c.first_token_at)
    db = create_engine(database_url)
    try:
        # a job's final token event leaves the worker just before its terminal row is committed
        deadline = time.monotonic() + wait_s
        while True:
            with db.connect() as conn:
                rows = {r.job_id: r for r in conn.execute(query.where(jobs.c.job_id.in_(ids)))}
            complete = sum(1 for r in rows.values() if r.first_token_at is not None)
            if complete == len(ids) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        db.dispose()
    parts: dict[str, list[float]] = {"intake": [], "schedule": [], "emit": []}
    for trace in traces:
        row, client_ttft = rows.get(trace.job_id), ttft_ms(trace)
        if row is None or None in (row.created_at, row.queued_at, row.first_token_at, client_ttft):
            continue
        parts["intake"].append(_ms(row.queued_at - row.created_at))
        parts["schedule"].append(_ms(row.first_token_at - row.queued_at))
        parts["emit"].append(client_ttft - _ms(row.first_token_at - row.created_at))
    out: dict[str, float | None] = {"rows": len(parts["intake"])}
    for name, values in parts.items():
        out[f"{name}_p50_ms"] = percentile(values, 50)
        out[f"{name}_max_ms"] = percentile(values, 100)
    return out


def _ms(delta) -> float:
    return delta.total_seconds() * 1000
