"""Writes job rows on a background thread, then publishes results and hands back offsets to ack.

The engine loop never waits for PostgreSQL between steps. For each batch, in order:
  1. dead-letter the rejected records (the broker has them before anything else happens);
  2. store every item: one transaction, or item by item when PostgreSQL refuses one (see writes.py);
  3. publish the results of the stored rows, retrying only the sends that failed;
  4. set `published_at` on those rows (the outbox: until then a redelivery or a sweeper republishes them);
  5. release the batch's source offsets for committing.
Steps 1-2 run on one thread, 3-5 on another: a batch's rows are stored while the batch before it waits for
the broker to take its results (at most one stored batch waits for that: a broker that is away holds the
stores up soon after). Under load a round of results through the relay takes several times as long as the
next batch's store; in one thread, every batch's terminal rows waited for the whole round before them.
Transient failures (service down, timeouts) retry with jittered exponential backoff and never drop work;
a committed offset therefore never passes an unstored job or an unpublished result. A result the broker
refuses for its size is published in its compact form (outbox.result_from_row); one refused even so stays
unpublished, its records unacked, and is tried again every REFUSED_RETRY_S. Between batches, the sweeper
(sweeper.py) publishes this deployment's results that no live worker is publishing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from schemas.job_key import JobKey
from schemas.jobs import JobResult
from schemas.topics import Topics
from workers.clock import utcnow
from workers.db import Engine, Row
from workers.db.jobs import cancel_requested
from workers.db.outbox import (
    COMPACT_NOTE,
    LEASE_S,
    count_unpublished,
    is_compact,
    mark_published,
    note_too_large,
    renew,
    result_from_row,
)
from workers.kafka_io import KeyLookup
from workers.kafka_io.errors import kafka_too_large
from workers.serving.errors import Backoff, describe_error, retry_transient
from workers.serving.failpoints import crash_if
from workers.serving.headers import job_headers
from workers.serving.outbox.delivery import Deliveries, Delivery, Ledger, MessageSender
from workers.serving.outbox.result_lookup import PublishedResults, result_message
from workers.serving.outbox.sweeper import SWEEP_S, Sweeper
from workers.serving.outbox.writes import (
    DeadLettered,
    Republish,
    Source,
    Stored,
    WriteContext,
    WriteItem,
    apply_all,
    await_stream_ends,
    describe_item,
    describe_key,
    job_of,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

CANCEL_WATCH_S = 2.0  # how often recorded cancels of this worker's in-flight jobs are looked up
UNPUBLISHED_COUNT_S = 30.0
STREAM_END_WAIT_S = 10.0  # at most, per batch, for the broker to confirm jobs' last token events
REFUSED_RETRY_S = 2 * LEASE_S  # a result refused even in its compact form: tried again this much later


@dataclass(frozen=True)
class _StoredBatch:
    """Batches whose rows are stored, on their way to the publishing thread."""

    batches: list[list[WriteItem]]  # as submitted (each counted in the depth until it is done)
    items: list[WriteItem]
    stored: Stored
    claimed: float  # when their leases were claimed (monotonic)


@dataclass(frozen=True)
class PersisterStats:
    depth: int  # items submitted, not yet done
    oldest_age_s: float  # age of the oldest of them (0 when none)
    unpublished: int  # terminal rows in the table whose result is not out yet (last count)


class Persister:
    def __init__(
        self,
        engine: Engine,
        producer: MessageSender,  # of results
        topics: Topics,
        worker_id: str,
        dead_letter: Callable[[DeadLettered], Delivery],
        published: KeyLookup,
        in_flight: Callable[[], Sequence[JobKey]] = tuple,
        failpoint: str = "",
        sweep_s: float | None = SWEEP_S,
    ) -> None:
        """`sweep_s`: how often to sweep the outbox for results nobody publishes (None: never)."""
        self._engine = engine
        self._producer = producer
        self._topics = topics
        self._worker_id = worker_id
        self._dead_letter = dead_letter
        self._published = published  # finds results already in the topic, before one is sent again
        self._in_flight = in_flight
        self._failpoint = failpoint  # tests only: die at a chosen point of a batch (see _crash_if)
        self._inbox: queue.Queue[tuple[float, list[WriteItem]] | None] = queue.Queue()
        self._done: queue.Queue[Source] = queue.Queue()  # offsets safe to ack, read by the loop
        self._cancels: queue.Queue[JobKey] = queue.Queue()  # in-flight jobs with a recorded cancel
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[float, int]] = {}  # batch id -> (submitted at, items)
        self._unpublished = 0
        self._depth = 0
        self._thread = threading.Thread(target=self._run, name="inferq-persister", daemon=True)
        self._stored: queue.Queue[_StoredBatch | None] = queue.Queue(maxsize=1)  # for the publishing thread
        self._publisher = threading.Thread(target=self._run_publishing, name="inferq-publisher", daemon=True)
        self._publishing = threading.Lock()  # held by whichever thread publishes (see _publish)
        self.written = 0  # items stored and published
        self._later: list[tuple[float, list[WriteItem]]] = []  # deferred items: (due, items)
        self._sweeper = None
        if sweep_s is not None:
            sources = (*topics.all_jobs, topics.control)
            prefix = topics.tenant_root if topics.tenants else None
            self._sweeper = Sweeper(
                engine, worker_id, sources, self._publish_swept, interval_s=sweep_s, source_prefix=prefix
            )

    # ---- engine-loop side -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._publisher.start()

    def submit(self, items: list[WriteItem]) -> None:
        if items:
            now = time.monotonic()
            with self._lock:
                self._pending[id(items)] = (now, len(items))
                self._depth += len(items)
            self._inbox.put((now, items))

    @property
    def depth(self) -> int:
        """Items submitted and not yet done (cheap: read every loop iteration)."""
        return self._depth

    def stats(self) -> PersisterStats:
        with self._lock:
            depth = sum(n for _, n in self._pending.values())
            oldest = min((t for t, _ in self._pending.values()), default=None)
        age = time.monotonic() - oldest if oldest is not None else 0.0
        return PersisterStats(depth, age, self._unpublished)

    def acked(self) -> list[Source]:
        return _drain(self._done)

    def cancelled(self) -> list[JobKey]:
        return _drain(self._cancels)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write everything submitted so far, then stop."""
        deadline = time.monotonic() + timeout_s
        self._inbox.put(None)
        self._thread.join(timeout_s)
        self._publisher.join(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive() and not self._publisher.is_alive():
            self._published.close()

    # ---- storing thread -----------------------------------------------------------------------
    def _run(self) -> None:
        next_watch = next_count = 0.0
        while True:
            now = time.monotonic()
            if now >= next_watch:
                next_watch = now + CANCEL_WATCH_S
                self._watch_cancels()
            if now >= next_count:
                next_count = now + UNPUBLISHED_COUNT_S
                self._count_unpublished()
            with self._lock:
                due = [items for at, items in self._later if at <= now]
                self._later = [(at, items) for at, items in self._later if at > now]
            for items in due:  # back in line, counted in the depth again (they were never done)
                self.submit(items)
            wait_s = CANCEL_WATCH_S
            if self._sweeper is not None:
                self._sweeper.sweep_if_due()
                wait_s = min(wait_s, self._sweeper.wait_s())
            try:
                first = self._inbox.get(timeout=wait_s)
            except queue.Empty:
                continue
            if first is None:
                self._stored.put(None)
                return
            batches, stop = [first[1]], False
            while True:  # merge what queued up meanwhile: fewer round trips under load
                try:
                    more = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batches.append(more[1])
            items = [item for batch in batches for item in batch]
            stored, claimed = _until_done("writing", len(items), self._store_batch, items)
            self._stored.put(_StoredBatch(batches, items, stored, claimed))  # waits while one is waiting
            if stop:
                self._stored.put(None)
                return

    def _run_publishing(self) -> None:
        while True:
            batch = self._stored.get()
            if batch is None:
                return
            _until_done("publishing", len(batch.items), self._publish_stored, batch)
            with self._lock:
                for submitted in batch.batches:
                    self._pending.pop(id(submitted), None)
                    self._depth -= len(submitted)

    def _store_batch(self, items: list[WriteItem]) -> tuple[Stored, float]:
        """Steps 1-2: dead letters out, rows stored; what was stored, and when its leases were claimed."""
        await_stream_ends(items, STREAM_END_WAIT_S)
        rejected = [i for i in items if isinstance(i, DeadLettered)]
        Deliveries("dead-lettered records").send(
            {_name(r, n): lambda r=r: self._dead_letter(r) for n, r in enumerate(rejected)}
        )
        claimed = time.monotonic()  # every lease the store writes runs at least LEASE_S from here
        stored = self._store(items)
        self._crash_if("crash-before-publish", stored)
        return stored, claimed

    def _publish_stored(self, batch: _StoredBatch) -> None:
        """Steps 3-5: the stored rows' results out, marked published, the records released."""
        items, stored, claimed = batch.items, batch.stored, batch.claimed
        Deliveries("results").send(
            {JobKey(r.tenant, r.job_id): lambda r=r: self._send_result(r) for r in stored.direct}
        )
        refused = self._publish(stored.outbox, claimed, stored.unsure, stored)
        self.written += len(items)
        for item, later in stored.superseded:
            log.info("%s: attempt dropped, the job runs from %s now", describe_item(item), later)
        unacked = {id(item) for item in stored.deferred} | {id(item) for item, _ in stored.superseded}
        unacked |= {id(item) for item in items if item.sources and job_of(item) in refused}
        acks = [s for item in items if id(item) not in unacked for s in item.sources]
        acks += [s for item, later in stored.superseded for s in item.sources if s != later]
        for source in acks:
            self._done.put(source)
        with self._lock:
            if stored.deferred:  # another live worker publishes these: look again once its lease may lapse
                self._later.append((time.monotonic() + LEASE_S / 2, stored.deferred))
            if refused:  # their records wait, unacked, for a publish that may work later (or a redelivery)
                self._later.append((time.monotonic() + REFUSED_RETRY_S, _republish(items, refused)))

    def _publish(
        self,
        rows: list[Row],
        claimed: float,
        unsure: set[JobKey],
        stored: Stored | None,
        until: float | None = None,
    ) -> set[JobKey]:
        """Publish outbox rows' results (their leases claimed at `claimed`) and mark them published; the
        jobs whose result the broker refused even in its compact form. One publish at a time: the sweeper's
        (on the storing thread) and a batch's share the lookup's Kafka consumer, which is not thread-safe."""
        results = {JobKey(row.tenant, row.job_id): result_from_row(row) for row in rows}
        ledger = _Publishing(self, claimed, stored, results)
        lookup = PublishedResults(self._published, self._topics.results_for, results)
        sends = {key: lambda key=key: self._send_result(results[key]) for key in results}
        with self._publishing:
            return Deliveries("results", ledger, lookup).send(sends, unsure, until)

    def _publish_swept(self, rows: list[Row], claimed: float, until: float) -> None:
        # each may be out already: its publisher died, maybe after the broker took it
        self._publish(rows, claimed, {JobKey(row.tenant, row.job_id) for row in rows}, None, until)

    def _compact(self, key: JobKey, exc: BaseException, results: dict[JobKey, JobResult]):
        """A result the broker refused: the send of its compact form, once its row says so (so whoever
        publishes the row later builds the same message), or None when there is nothing smaller to send."""
        result = results[key]
        if not kafka_too_large(exc) or is_compact(result.error):
            return None
        size = len(result_message(result))
        note = (
            f"{COMPACT_NOTE} ({size} bytes; {describe_error(exc)}): published without output_text, "
            "choices and metadata, which this row keeps"
        )
        noting = lambda conn: note_too_large(conn, key, self._worker_id, note, utcnow())  # noqa: E731
        try:
            row = self._retry("noting a result too large", lambda: self._in_tx(noting))
        except Exception as again:  # noqa: BLE001 - the row stays as it is: tried again later
            error = describe_error(again)
            log.error("job %s: could not note its result as too large: %s", describe_key(key), error)
            return None
        if row is None:  # no longer ours to publish (taken over, or published meanwhile)
            return None
        results[key] = result_from_row(row)
        log.error("job %s: its result (%d bytes) is too large for the results topic; publishing it "
                  "without output_text, choices and metadata (its row keeps them)",
                  describe_key(key), size)  # fmt: skip
        return lambda: self._send_result(results[key])

    def _keep(self, ids: list[JobKey], claimed: float) -> set[JobKey]:
        """The results still this worker's to publish, their leases renewed. Leases written moments ago
        are ours without asking (nobody takes a row over before its lease lapses): a round trip saved
        per batch, and its GIL time."""
        if time.monotonic() - claimed < LEASE_S / 3:
            return set(ids)
        renewing = lambda conn: renew(conn, ids, self._worker_id, utcnow())  # noqa: E731
        return self._retry("renewing publish leases", lambda: self._in_tx(renewing))

    def _mark_published(self, ids: list[JobKey], stored: Stored | None) -> None:
        if stored is not None:
            self._crash_if("crash-after-publish", stored)
        try:
            mark = lambda conn: mark_published(conn, ids, self._worker_id, utcnow())  # noqa: E731
            self._retry("marking results published", lambda: self._in_tx(mark))
        except Exception as exc:  # noqa: BLE001 - the rows stay in the outbox; a redelivery republishes
            log.error("marking %d results published failed: %s", len(ids), describe_error(exc))

    def _send_result(self, result: JobResult) -> Delivery:
        headers = job_headers(result.job_id, result.attempt, result.tenant)
        topic = self._topics.results_for(result.tenant)  # per-tenant topics: the tenant's own
        return self._producer.send(topic, result.job_id, result_message(result), headers)

    def _crash_if(self, name: str, stored: Stored) -> None:
        crash_if(self._failpoint, name, any(row.status == "succeeded" for row in stored.outbox))

    def _store(self, items: list[WriteItem]) -> Stored:
        ctx = WriteContext(self._worker_id, utcnow())
        try:
            return self._retry("writing job rows", lambda: self._in_tx(lambda c: apply_all(c, items, ctx)))
        except Exception as exc:  # noqa: BLE001 - not transient: some item's data is refused
            log.warning(
                "a batch of %d writes was refused (%s); writing them one by one",
                len(items),
                describe_error(exc),
            )
        out = Stored()
        for item in items:
            out += self._store_alone(item, ctx)
        return out

    def _store_alone(self, item: WriteItem, ctx: WriteContext) -> Stored:
        try:
            return self._retry("writing a job row", lambda: self._in_tx(lambda c: item.apply(c, ctx)))
        except Exception as exc:  # noqa: BLE001
            error = describe_error(exc)
        log.error("write refused for %s: %s; storing its simplest form", describe_item(item), error)
        try:
            return self._retry(
                "writing a fallback row", lambda: self._in_tx(lambda c: item.fallback(c, ctx, error))
            )
        except Exception as again:  # noqa: BLE001 - nothing simpler exists: log, never wedge
            log.error("dropped the write for %s: %s", describe_item(item), describe_error(again))
            return Stored()

    def _watch_cancels(self) -> None:
        ids = list(self._in_flight())
        if not ids:
            return
        try:
            found = self._in_tx(lambda c: cancel_requested(c, ids))
        except Exception as exc:  # noqa: BLE001 - a lookup that can wait for the next round
            log.debug("cancel lookup failed: %s", describe_error(exc))
            return
        for key in found:
            self._cancels.put(key)

    def _count_unpublished(self) -> None:
        try:
            self._unpublished = self._in_tx(count_unpublished)
        except Exception as exc:  # noqa: BLE001
            log.debug("unpublished count failed: %s", describe_error(exc))

    def _in_tx(self, work):
        with self._engine.begin() as conn:
            return work(conn)

    def _retry(self, what: str, work):
        return retry_transient(work, what)


class _Publishing(Ledger):
    """A batch of outbox rows' results on their way: their leases (claimed at `claimed`) renewed before
    each round, their rows marked published once out, and a result too large replaced by its compact form."""

    def __init__(
        self, persister: Persister, claimed: float, stored: Stored | None, results: dict[JobKey, JobResult]
    ) -> None:
        self.persister, self.claimed, self.stored, self.results = persister, claimed, stored, results

    def ours(self, names: list[JobKey]) -> set[JobKey]:
        return self.persister._keep(names, self.claimed)

    def delivered(self, names: list[JobKey]) -> None:
        self.persister._mark_published(names, self.stored)

    def replacement(self, name: JobKey, exc: BaseException) -> Callable[[], Delivery] | None:
        return self.persister._compact(name, exc, self.results)


def _until_done(what: str, size: int, work: Callable[..., T], *args: Any) -> T:
    """A bug must not end a persister thread (every later write would wait forever): log it and try
    again; every step is idempotent, and the items' offsets stay uncommitted until they are done."""
    backoff = Backoff(base_s=1.0, cap_s=60.0)
    while True:
        try:
            return work(*args)
        except Exception:  # noqa: BLE001
            delay = backoff.next_delay()
            log.exception("%s a batch of %d items failed unexpectedly; retrying in %.0fs", what, size, delay)
            time.sleep(delay)


def _drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def _republish(items: list[WriteItem], keys: set[JobKey]) -> list[WriteItem]:
    """One Republish per job, carrying every record of these items that waits for its result."""
    sources: dict[JobKey, list[Source]] = {}
    for item in items:
        key = job_of(item)
        if key in keys and item.sources:
            sources.setdefault(key, []).extend(item.sources)
    return [Republish(job_id, tuple(srcs), tenant) for (tenant, job_id), srcs in sources.items()]


def _name(r: DeadLettered, n: int) -> str:
    return f"{r.job_id or 'record'}#{n}"
