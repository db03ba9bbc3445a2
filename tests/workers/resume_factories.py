"""Helpers of the resume tests: jobs placed on one partition (so one worker holds them all), their saved
progress as SQL shows it, their streams read as JobClient reads them, and what a uninterrupted run gave."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from sqlalchemy import Engine, text

from schemas.jobs import JobResult, TokenEvent
from workers.client import JobClient
from workers.client.token_order import ContinuousOutput, TokenOrder
from workers.kafka_io import partition_for_key
from workers.settings import Settings

PARTITIONS = 4  # INFERQ_JOBS_PARTITIONS of the test deployments


def on_one_partition(names: Iterable[str], prefix: str, partition: int = 0) -> dict[str, str]:
    """A job id per name, all of them keyed to `partition` (so the worker owning it holds every job)."""
    out = {}
    for name in names:
        i = 0
        while partition_for_key(job_id := f"{name}-{prefix}-{i}", PARTITIONS) != partition:
            i += 1
        out[name] = job_id
    return out


def saved_tokens(db: Engine, job_ids: Iterable[str]) -> dict[str, int]:
    """Tokens each job has saved (every sample together), as job_progress_summary shows them."""
    with db.connect() as conn:
        rows = conn.execute(
            text("SELECT job_id, sum(tokens) FROM job_progress_summary WHERE job_id = ANY(:ids) GROUP BY 1"),
            {"ids": list(job_ids)},
        )
        return {job_id: int(tokens) for job_id, tokens in rows}


def wait_saved(db: Engine, wanted: dict[str, int], timeout_s: float = 300) -> dict[str, int]:
    """Until each job has saved at least its wanted tokens; what they saved then."""
    deadline = time.monotonic() + timeout_s
    while True:
        saved = saved_tokens(db, wanted)
        if all(saved.get(j, 0) >= n for j, n in wanted.items()):
            return saved
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs did not save their tokens in time: {saved} of {wanted}")
        time.sleep(0.05)


class Streams:
    """JobClient.stream of each job on a thread of its own, from before the job is posted: the events each
    yielded (a stream that fails keeps its error)."""

    def __init__(self, client: JobClient, job_ids: Iterable[str], timeout_s: float = 600) -> None:
        self.events: dict[str, list[TokenEvent]] = {}
        self.errors: dict[str, BaseException] = {}
        self._threads = [
            threading.Thread(target=self._follow, args=(client, j, timeout_s), daemon=True) for j in job_ids
        ]
        for t in self._threads:
            t.start()

    def _follow(self, client: JobClient, job_id: str, timeout_s: float) -> None:
        got = self.events.setdefault(job_id, [])
        try:
            got.extend(client.stream(job_id, timeout_s, since_ms=int(time.time() * 1000) - 5000))
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            self.errors[job_id] = exc

    def join(self, timeout_s: float = 120) -> None:
        for t in self._threads:
            t.join(timeout_s)

    def texts(self, job_id: str) -> dict[int, str]:
        return joined(self.events[job_id])


def joined(events: Iterable[TokenEvent]) -> dict[int, str]:
    """Each sample's text from events as a consumer joins them (starting over at a `restarted` one)."""
    out: dict[int, str] = {}
    for e in events:
        if e.restarted:
            out = {}
        out[e.index] = out.get(e.index, "") + e.text
    return out


def as_client_reads(events: list[TokenEvent]) -> list[TokenEvent]:
    """A job's events from the topic, in topic order, as JobClient.stream hands them on."""
    order, output, out = TokenOrder(), ContinuousOutput(), []
    for e in events:
        for ready in order.add(e):
            new = output.take(ready)
            if new is not None:
                out.append(new)
    return out


def positions(events: Iterable[TokenEvent], attempt: int, index: int = 0) -> dict[int, str]:
    """Character position -> character of one sample's text, as one attempt's events state it."""
    out: dict[int, str] = {}
    for e in events:
        if e.attempt == attempt and e.index == index and e.text_offset is not None:
            for i, ch in enumerate(e.text):
                out[e.text_offset + i] = ch
    return out


def choice_texts(result: JobResult) -> dict[int, str]:
    return {c.index: c.text for c in result.choices} or {0: result.output_text or ""}


def reference(client: JobClient, job: dict, priority: str = "normal", timeout_s: float = 600) -> JobResult:
    """The result of an uninterrupted run of `job` (under its own id)."""
    sent = client.submit(job, priority)
    return client.wait(sent, timeout_s)


def stream_records(settings: Settings, since_ms: int, job_ids: Iterable[str], timeout_s: float = 300) -> list:
    """Every record of the tokens topic since a time, read until each of these jobs' final event is in."""
    from tests.workers.worker_factories import read_topic

    missing, seen = set(job_ids), [0]

    def complete(records: list) -> bool:
        for r in records[seen[0] :]:
            if (event := TokenEvent.model_validate_json(r.value)).final:
                missing.discard(event.job_id)
        seen[0] = len(records)
        return not missing

    return read_topic(settings, settings.topics.tokens, since_ms, complete, timeout_s)
