"""Whether results are in the results topic already: the check that makes re-publishing a row safe.

A terminal row whose `published_at` is empty may or may not have had its result sent (a worker can die
between the send and the mark). Before sending again, the topic is searched for the exact bytes the row
yields, from shortly before the row finished.
"""

from __future__ import annotations

from datetime import datetime

from schemas.jobs import JobResult
from workers.kafka_io import KeyLookup

LOOK_SLACK_MS = 60_000  # a result's Kafka timestamp may precede its row's finished_at by clock skew


def result_message(result: JobResult) -> bytes:
    """A result's message: the same bytes every time for the same row (what a lookup compares)."""
    return result.model_dump_json().encode()


def published_already(
    lookup: KeyLookup, topic: str, ids: list[str], results: dict[str, JobResult]
) -> set[str]:
    """Which of these results are in the topic already (raises when the broker cannot say)."""
    finished = {job_id: results[job_id].timings.finished_at for job_id in ids}
    wanted = {job_id: (since, result_message(results[job_id])) for job_id, since in look_since_ms(finished)}
    return lookup.present(topic, wanted)


def look_since_ms(finished: dict[str, datetime | None]) -> list[tuple[str, int]]:
    """From when to look for each job's result: its row's finish (the result was sent after it), less a
    minute for the clocks of the worker that wrote the row and of the one that sent the result. A row
    without `finished_at` has no bound to look from: it is not looked for (its result is sent)."""
    out = []
    for job_id, at in finished.items():
        if at is not None:
            out.append((job_id, max(0, int(at.timestamp() * 1000) - LOOK_SLACK_MS)))
    return out
