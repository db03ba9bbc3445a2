"""Advancing the API's batches through the bulk path: validate the input file, produce its lines as
low-priority jobs, and write the output and error files once they are done, expired or cancelled.

Every API process runs one driver thread; a batch is advanced by whichever holds its advisory lock (the
bulk path's), and all its state is in its api_batches row, so any process can take over from one that died.
Lines are read, turned into jobs and answered by the bulk path's own functions (read_lines, to_job,
write_lines), so a Batch line becomes a `jobs` row with bulk_id = the batch id, as `inferq bulk` makes.

Memory stays bounded whatever a file's size: the input is read from PostgreSQL a chunk at a time
(api_files.lines), production resumes at the byte where it stopped (`input_offset`), and the output and
error files are written a chunk at a time as their lines are made.

Batches advance fairly: a batch keeps at most `api_batch_in_flight` of its lines queued or running (the
next ones are produced as those finish), and each round of the driver gives every open batch a turn of at
most CHECKPOINT_LINES lines, the tenants' batches interleaved. A 50,000-line batch so never has more than a
window of jobs ahead of another tenant's batch in the queue, and the workers' tenant fairness does the rest.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from itertools import islice
from typing import Any

from schemas.jobs import JobRequest
from schemas.statuses import TERMINAL_STATUSES
from workers.api.context import APIContext
from workers.api.events import BatchEvents
from workers.api.models import ModelNames, job_model
from workers.api.protocol import batch_object
from workers.bulk.batch_format import BatchLine, LineError, job_id_for, parse_line, read_lines, to_job
from workers.bulk.finalize import write_lines
from workers.clock import utcnow
from workers.db import api_batches, api_files, api_requests, bulk_jobs
from workers.db.api_batches import Row
from workers.db.api_files import FILE_CHUNK_BYTES

log = logging.getLogger(__name__)

CHECKPOINT_LINES = 200  # lines one batch may hand to Kafka in one turn (and between two checkpoints)
CANCEL_GRACE_S = 30.0  # after a cancel, how long jobs already running may finish before the files are written
# tests only (INFERQ_FAILPOINT): kill -9 this API process after a batch's first checkpoint short of its end
KILL_AFTER_CHECKPOINT = "api-kill-after-checkpoint"
MAX_ERRORS = 100  # errors.data entries kept of a batch that failed validation
HOUSEKEEPING_S = 60.0  # how often abandoned uploads, expired files and expired request keys are removed
ABANDONED_AFTER = timedelta(hours=1)  # a file still `uploading` this long after it began: its writer died


def request_counts(conn: Any, row: Row) -> dict[str, int]:
    """OpenAI's request_counts: the final counts once the files are written, else the jobs rows so far."""
    if row["final_counts"] is not None:
        return dict(row["final_counts"])
    counts = bulk_jobs.job_counts(conn, row["batch_id"], row["tenant"])
    done = bulk_jobs.terminal_jobs(counts)
    succeeded = counts.get("succeeded", 0)
    return {"total": row["total"], "completed": succeeded, "failed": done - succeeded}


def describe(conn: Any, row: Row) -> dict[str, Any]:
    """The Batch object of a row: its counts and tokens so far while it runs, its final ones after."""
    if row.get("usage") is None and row["status"] != "validating":
        row = {**row, "usage": bulk_jobs.token_sums(conn, row["batch_id"], row["tenant"])}
    return batch_object(row, request_counts(conn, row))


def interleaved(batches: list[Row]) -> list[Row]:
    """Open batches in turn order: each tenant's oldest first, then each one's second, and so on (the order
    within a tenant is the batches' age)."""
    by_tenant: dict[str, list[Row]] = {}
    for batch in batches:
        by_tenant.setdefault(batch["tenant"], []).append(batch)
    order: list[Row] = []
    rank = 0
    while len(order) < len(batches):
        order += [rows[rank] for rows in by_tenant.values() if rank < len(rows)]
        rank += 1
    return order


class _FileWriter:
    """An output file written a chunk at a time as its lines are made; `uploading` (invisible) until
    `finish` is called in the transaction that makes the batch final."""

    def __init__(
        self, ctx: APIContext, tenant: str, purpose: str, filename: str, lifetime_s: int | None = None
    ) -> None:
        self.ctx, self.tenant, self.purpose, self.filename = ctx, tenant, purpose, filename
        self.lifetime_s = lifetime_s
        self.file_id: str | None = None
        self.size = 0
        self._seq = 0
        self._pending = bytearray()

    def write(self, text: str) -> None:
        data = text.encode()
        self.size += len(data)
        self._pending += data
        while len(self._pending) >= FILE_CHUNK_BYTES:
            self._store(bytes(self._pending[:FILE_CHUNK_BYTES]))
            del self._pending[:FILE_CHUNK_BYTES]

    def flush(self) -> None:
        """What is left, stored (the last chunk), so `finish` has only the row to change."""
        if self._pending or self._seq == 0:
            self._store(bytes(self._pending))
            self._pending.clear()

    def finish(self, conn: Any) -> str:
        assert self.file_id is not None, "flush first"
        api_files.finish(conn, self.file_id, self.size)
        return self.file_id

    def discard(self) -> None:
        if self.file_id is not None:
            with self.ctx.db.begin() as conn:
                api_files.discard(conn, self.file_id)

    def _store(self, chunk: bytes) -> None:
        with self.ctx.db.begin() as conn:
            if self.file_id is None:
                self.file_id = api_files.begin(
                    conn, self.tenant, self.purpose, self.filename, self.lifetime_s
                )
            api_files.append(conn, self.file_id, self._seq, chunk)
        self._seq += 1


class BatchDriver:
    def __init__(
        self,
        ctx: APIContext,
        events: BatchEvents | None,
        tick_s: float = 1.0,
        fleet_models: Callable[[], tuple[str, ...]] | None = None,
    ) -> None:
        """`fleet_models`: the model names a line may give (default: the configured ones)."""
        self.ctx = ctx
        self.events = events
        self.tick_s = tick_s
        self.fleet_models = fleet_models or (lambda: ctx.models)
        self.window = max(1, ctx.settings.api_batch_in_flight)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inferq-batch-driver", daemon=True)
        self._housekept = -float("inf")

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Look at the batches now (a batch was created or cancelled)."""
        self._wake.set()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = False
            try:
                busy = self.tick()
                self._housekeeping()
            except Exception:  # noqa: BLE001 - the database or broker away: try again next tick
                log.exception("batch driver: tick failed; trying again")
            if not busy:  # a batch with more to produce now is given its next turn at once
                self._wake.wait(self.tick_s)
            self._wake.clear()

    def tick(self) -> bool:
        """One round: every open batch of this deployment advanced by a turn, tenants interleaved; whether
        any batch has more to produce at once."""
        with self.ctx.db.connect() as conn:
            found = api_batches.open_batches(conn, self.ctx.settings.topic_prefix)
        busy = False
        for batch in interleaved(found):
            if self._stop.is_set():
                return False
            with bulk_jobs.bulk_lock(self.ctx.db, batch["batch_id"]) as got:
                if got:  # else another API process is advancing it
                    busy |= self.advance(batch["batch_id"])
        return busy

    def _housekeeping(self) -> None:
        if time.monotonic() - self._housekept < HOUSEKEEPING_S:
            return
        self._housekept = time.monotonic()
        now = utcnow()
        with self.ctx.db.begin() as conn:
            swept = api_files.sweep_abandoned(conn, now - ABANDONED_AFTER)
            api_files.purge_expired(conn)  # files past their expires_at (reads leave them out at once)
            api_requests.purge(conn, now)
        if swept:
            log.info("removed %d files whose upload never finished", swept)

    # ---- one batch -------------------------------------------------------------------------------------
    def advance(self, batch_id: str) -> bool:
        """One turn of a batch; whether it has more lines it could produce at once."""
        with self.ctx.db.connect() as conn:
            row = api_batches.get_any(conn, batch_id)
        if row is None:
            return False
        now = utcnow()
        status = row["status"]
        if status in api_batches.FINISHED:
            self._publish(row)
        elif status in ("validating", "in_progress") and row["expires_at"] <= now:
            self._send_cancels(row)
            self._finalize(row, ("validating", "in_progress"), "expired", "batch_expired")
        elif status == "validating":
            self._validate(row)
            return True
        elif status == "in_progress":
            more = self._produce(row)
            with self.ctx.db.connect() as conn:
                row = api_batches.get_any(conn, batch_id)
            if row["status"] == "in_progress" and self._all_done(row):
                self._finalize(row, ("in_progress",), "completed", "missing")
            return more
        elif status == "finalizing":  # a process died while writing the files: write them again
            self._finalize(row, ("finalizing",), "completed", "missing")
        elif status == "cancelling":
            if row["cancels_sent_at"] is None:
                self._send_cancels(row)
            grace_over = (now - row["cancelling_at"]).total_seconds() >= CANCEL_GRACE_S
            if grace_over or self._all_done(row):
                self._finalize(row, ("cancelling",), "cancelled", "batch_cancelled")
        return False

    def _raw_lines(self, row: Row, offset: int = 0) -> Iterator[tuple[bytes, int]]:
        return api_files.lines(self.ctx.db, row["input_file_id"], offset)

    def _items(self, row: Row) -> Iterator[BatchLine | LineError]:
        """Every line of the input, parsed and numbered (duplicate custom_ids found), read as it goes."""
        return read_lines(raw for raw, _ in self._raw_lines(row))

    def _input_exists(self, row: Row) -> bool:
        with self.ctx.db.connect() as conn:
            return api_files.get(conn, row["tenant"], row["input_file_id"]) is not None

    def _validate(self, row: Row) -> None:
        errors: list[dict[str, Any]] = []
        total = 0
        model = None
        if not self._input_exists(row):
            errors.append(_error("missing_file", f"input file {row['input_file_id']} no longer exists", None))
        else:
            served = self.fleet_models()
            names = ModelNames(self.ctx.db, served, row["tenant"])
            for item in self._items(row):
                problem = self._line_problem(row, item, names)
                if problem is not None and len(errors) < MAX_ERRORS:
                    errors.append(_error(*problem))
                if model is None and isinstance(item, BatchLine):
                    model = item.model or (served[0] if served else None)
                total += 1
            if total == 0 and not errors:
                errors.append(_error("empty_file", "the input file has no request lines", None))
        with self.ctx.db.begin() as conn:
            if errors:
                api_batches.transition(conn, row["batch_id"], ("validating",), "failed", errors=errors,
                                       failed_at=utcnow(), model=model, final_counts={"total": total,
                                       "completed": 0, "failed": 0})  # fmt: skip
            else:
                api_batches.transition(conn, row["batch_id"], ("validating",), "in_progress", total=total,
                                       model=model, in_progress_at=utcnow())  # fmt: skip
        log.info("batch %s: %s (%d lines)", row["batch_id"], "failed" if errors else "in_progress", total)
        self.wake()

    def _line_problem(
        self, row: Row, item: BatchLine | LineError, names: ModelNames
    ) -> tuple[str, str, int | None] | None:
        if isinstance(item, LineError):
            return "invalid_request", item.message, item.line_no
        if item.url != row["endpoint"]:
            return (
                "invalid_url",
                f"line {item.line_no}: url {item.url} is not the batch's endpoint",
                item.line_no,
            )
        if not names.allows(item.model):  # the base, or an adapter of the batch's tenant
            return (
                "model_not_found",
                f"line {item.line_no}: the model '{item.model}' does not exist or you have no access to it",
                item.line_no,
            )
        return None

    def _in_flight(self, row: Row) -> int:
        """The batch's lines handed to Kafka whose job has not ended yet."""
        with self.ctx.db.connect() as conn:
            counts = bulk_jobs.job_counts(conn, row["batch_id"], row["tenant"])
        return max(0, row["submitted"] - bulk_jobs.terminal_jobs(counts))

    def _produce(self, row: Row) -> bool:
        """Hand up to a turn's lines after the checkpoint to Kafka as low-priority jobs, as many as the
        batch's window has room for; whether it could go on at once (a full turn, room left, lines left)."""
        if row["submitted"] >= row["total"]:
            return False
        room = self.window - self._in_flight(row)
        wanted = min(CHECKPOINT_LINES, room)
        if wanted <= 0:
            return False
        lines, end = self._next_lines(row, wanted)
        if not lines:
            return False
        jobs = [self._job(line, row) for line in lines]
        self.ctx.client.submit_many(jobs, "low")
        for job in jobs:
            self.ctx.client.forget(job.job_id)
        done = row["submitted"] + len(lines)
        with self.ctx.db.begin() as conn:
            api_batches.update(conn, row["batch_id"], submitted=done, input_offset=end)
            status = api_batches.get_any(conn, row["batch_id"])["status"]
        if self.ctx.settings.failpoint == KILL_AFTER_CHECKPOINT and done < row["total"]:
            log.error("failpoint %s: killing this process", KILL_AFTER_CHECKPOINT)
            os.kill(os.getpid(), signal.SIGKILL)  # tests: mid-production, its advisory lock held
        return status == "in_progress" and done < row["total"] and len(lines) == wanted and wanted < room

    def _job(self, line: BatchLine, row: Row) -> JobRequest:
        """A line's job: the base unnamed, an adapter by its name (validated; if it was removed since,
        the worker refuses the job and the line is an error in the output)."""
        job = to_job(line, bulk_id=row["batch_id"], tenant=row["tenant"])
        return job.model_copy(update={"model": job_model(line.model, self.fleet_models())})

    def _next_lines(self, row: Row, count: int) -> tuple[list[BatchLine], int]:
        """Up to `count` request lines from the checkpoint (`input_offset`) on, and the offset after them."""
        lines: list[BatchLine] = []
        end = row["input_offset"]
        for raw, after in self._raw_lines(row, end):
            end = after
            if not raw.strip():
                continue
            item = parse_line(raw.decode("utf-8"), row["submitted"] + len(lines) + 1)
            if isinstance(item, LineError):  # validated before: cannot happen unless the file changed
                raise RuntimeError(f"batch {row['batch_id']}: {item.message}")
            lines.append(item)
            if len(lines) == count:
                break
        return lines, end

    def _job_ids(self, row: Row) -> Iterator[list[str]]:
        """The job ids of the lines submitted so far, 500 at a time (their custom_ids alone are read)."""
        ids = (
            job_id_for(row["batch_id"], json.loads(raw)["custom_id"])
            for raw, _ in self._raw_lines(row)
            if raw.strip()
        )
        ids = islice(ids, row["submitted"])
        while chunk := list(islice(ids, 500)):
            yield chunk

    def _all_done(self, row: Row) -> bool:
        """Whether every submitted line's job is terminal (all of them, unless cancelling)."""
        if row["status"] == "in_progress" and row["submitted"] < row["total"]:
            return False
        with self.ctx.db.connect() as conn:
            counts = bulk_jobs.job_counts(conn, row["batch_id"], row["tenant"])
        if bulk_jobs.terminal_jobs(counts) >= row["submitted"]:
            return True
        if counts.get("queued", 0) + counts.get("running", 0):
            return False
        # a cancel recorded before its job arrived leaves a row without bulk_id: look by job_id
        for ids in self._job_ids(row):
            with self.ctx.db.connect() as conn:
                rows = bulk_jobs.rows_for(conn, row["tenant"], ids)
            if len(rows) < len(ids) or any(r["status"] not in TERMINAL_STATUSES for r in rows.values()):
                return False
        return True

    def _send_cancels(self, row: Row) -> None:
        for ids in self._job_ids(row):
            with self.ctx.db.connect() as conn:
                rows = bulk_jobs.rows_for(conn, row["tenant"], ids)
            for job_id in ids:
                found = rows.get(job_id)
                if found is None or found["status"] not in TERMINAL_STATUSES:
                    self.ctx.client.cancel(job_id, row["tenant"])
        with self.ctx.db.begin() as conn:
            api_batches.update(conn, row["batch_id"], cancels_sent_at=utcnow())

    def _finalize(self, row: Row, from_statuses: tuple[str, ...], to: str, unfinished_code: str) -> None:
        """Write the output and error files as their lines are made, then make them visible and move to `to`
        in one transaction: no reader sees a batch with half its files, and a crash before the commit leaves
        the batch to do again (the half-written files are swept)."""
        batch_id, tenant = row["batch_id"], row["tenant"]
        if to == "completed" and row["status"] == "in_progress":
            with self.ctx.db.begin() as conn:
                if not api_batches.transition(
                    conn, batch_id, ("in_progress",), "finalizing", finalizing_at=utcnow()
                ):
                    return
            from_statuses = ("finalizing",)
        lifetime = row.get("output_expires_after")  # the files live that long from their creation
        out = _FileWriter(self.ctx, tenant, "batch_output", f"{batch_id}_output.jsonl", lifetime)
        err = _FileWriter(self.ctx, tenant, "batch_output", f"{batch_id}_error.jsonl", lifetime)
        try:

            def lookup(ids: list[str]) -> dict[str, Row]:
                with self.ctx.db.connect() as conn:
                    return bulk_jobs.rows_for(conn, tenant, ids)

            items = self._items(row) if self._input_exists(row) else iter(())
            counts = write_lines(
                items, batch_id, lookup, out.write, err.write, unfinished_code=unfinished_code
            )
            final = {"succeeded": counts.succeeded, "failed": counts.failed, "invalid": counts.invalid,
                     "unfinished": counts.unfinished}  # fmt: skip
            request = {
                "total": sum(final.values()),
                "completed": final["succeeded"],
                "failed": final["failed"] + final["invalid"] + final["unfinished"],
            }
            keep_out, keep_err = out.size > 0 or err.size == 0, err.size > 0
            for writer, keep in ((out, keep_out), (err, keep_err)):
                if keep:
                    writer.flush()
            with self.ctx.db.begin() as conn:
                usage = bulk_jobs.token_sums(conn, batch_id, tenant)
                files = {
                    "output_file_id": out.finish(conn) if keep_out else None,
                    "error_file_id": err.finish(conn) if keep_err else None,
                }
                moved = api_batches.transition(
                    conn, batch_id, from_statuses, to, final_counts=request, usage=usage, **files,
                    **{f"{to}_at": utcnow()},
                )  # fmt: skip
                if not moved:  # another verdict came first (a cancel, the expiry): the files go with it
                    raise _Overtaken
        except _Overtaken:
            out.discard()
            err.discard()
            return
        except BaseException:
            out.discard()
            err.discard()
            raise
        log.info("batch %s: %s, %s", batch_id, to, request)
        self.wake()

    def _publish(self, row: Row) -> None:
        if self.events is None:
            return
        with self.ctx.db.connect() as conn:
            batch = describe(conn, row)
        self.events.publish(batch)
        with self.ctx.db.begin() as conn:
            api_batches.update(conn, row["batch_id"], event_published_at=utcnow())


class _Overtaken(Exception):
    pass


def _error(code: str, message: str, line: int | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": line}


def expiry(ctx: APIContext, now: Any) -> Any:
    """When a batch created now expires: its 24h window, or the shorter one a test configured."""
    return now + timedelta(seconds=ctx.batch_window_s or 24 * 3600)
