"""Whether results are in the results topic already: the check that makes re-publishing a row safe.

A terminal row whose `published_at` is empty may or may not have had its result sent (a worker can die
between the send and the mark). Before sending again, the topic is searched for the exact bytes the row
yields, from shortly before the row finished.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from schemas.job_key import JobKey
from schemas.jobs import JobResult
from workers.kafka_io import KeyLookup

LOOK_SLACK_MS = 60_000  # a result's Kafka timestamp may precede its row's finished_at by clock skew


def result_message(result: JobResult) -> bytes:
    """A result's message: the same bytes every time for the same row (what a lookup compares)."""
    return result.model_dump_json().encode()


def published_already(
    lookup: KeyLookup,
    topic_of: Callable[[str], str],
    keys: list[JobKey],
    results: dict[JobKey, JobResult],
) -> set[JobKey]:
    """Which of these results (by (tenant, job_id)) are in their tenant's results topic already (raises
    when the broker cannot say). The topic is searched by Kafka key, the job_id: two tenants' jobs of one
    id (on a shared topic) are looked for in separate rounds, each found by its own exact bytes."""
    finished = {key: results[key].timings.finished_at for key in keys}
    # each round: topic -> job_id -> (tenant, (since, bytes)); a round holds an id once per topic
    rounds: list[dict[str, dict[str, tuple[str, tuple[int, bytes]]]]] = []
    for (tenant, job_id), since in look_since_ms(finished):
        topic = topic_of(tenant)
        wanted = (since, result_message(results[JobKey(tenant, job_id)]))
        free = next((r for r in rounds if job_id not in r.get(topic, {})), None)
        if free is None:
            free = {}
            rounds.append(free)
        free.setdefault(topic, {})[job_id] = (tenant, wanted)
    found: set[JobKey] = set()
    for r in rounds:
        for topic, by_id in r.items():
            present = lookup.present(topic, {job_id: wanted for job_id, (_, wanted) in by_id.items()})
            found |= {JobKey(by_id[job_id][0], job_id) for job_id in present}
    return found


class PublishedResults:
    """The delivery `Lookup` of a batch of results: which are in their tenant's results topic already."""

    def __init__(self, lookup: KeyLookup, topic_of: Callable[[str], str], results: dict[JobKey, JobResult]):
        self.lookup, self.topic_of, self.results = lookup, topic_of, results

    def landed(self, names: list[JobKey]) -> set[JobKey]:
        return published_already(self.lookup, self.topic_of, names, self.results)


def look_since_ms(finished: dict[JobKey, datetime | None]) -> list[tuple[JobKey, int]]:
    """From when to look for each job's result: its row's finish (the result was sent after it), less a
    minute for the clocks of the worker that wrote the row and of the one that sent the result. A row
    without `finished_at` has no bound to look from: it is not looked for (its result is sent)."""
    out = []
    for job_id, at in finished.items():
        if at is not None:
            out.append((job_id, max(0, int(at.timestamp() * 1000) - LOOK_SLACK_MS)))
    return out
