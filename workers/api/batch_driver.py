"""Advancing the API's batches through the bulk path: validate the input file, produce its lines as
low-priority jobs, and write the output and error files once they are done, expired or cancelled.

Every API process runs one driver thread; a batch is advanced by whichever holds its advisory lock (the
bulk path's), and all its state is in its api_batches row, so any process can take over from one that died.
Lines are read, turned into jobs and answered by the bulk path's own functions (read_lines, to_job,
write_results), so a Batch line becomes a `jobs` row with bulk_id = the batch id, as `inferq bulk` makes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from itertools import islice
from pathlib import Path
from typing import Any

from schemas.jobs import JobRequest
from schemas.statuses import TERMINAL_STATUSES
from workers.api.context import APIContext
from workers.api.events import BatchEvents
from workers.api.models import ModelNames, job_model
from workers.api.protocol import batch_object
from workers.bulk.batch_format import BatchLine, LineError, job_id_for, read_lines, to_job
from workers.bulk.finalize import write_results
from workers.clock import utcnow
from workers.db import api_batches, api_files, bulk_jobs
from workers.db.api_batches import Row

log = logging.getLogger(__name__)

CHECKPOINT_LINES = 200  # lines handed to Kafka between two checkpoints (bulk's produce has the same)
CANCEL_GRACE_S = 30.0  # after a cancel, how long jobs already running may finish before the files are written
# tests only (INFERQ_FAILPOINT): kill -9 this API process after a batch's first checkpoint short of its end
KILL_AFTER_CHECKPOINT = "api-kill-after-checkpoint"
MAX_ERRORS = 100  # errors.data entries kept of a batch that failed validation
PURGE_EVERY_S = 60.0  # how often a driver deletes expired files (reads leave them out at once)


def request_counts(conn: Any, row: Row) -> dict[str, int]:
    """OpenAI's request_counts: the final counts once the files are written, else the jobs rows so far."""
    if row["final_counts"] is not None:
        return dict(row["final_counts"])
    counts = bulk_jobs.job_counts(conn, row["batch_id"], row["tenant"])
    done = bulk_jobs.terminal_jobs(counts)
    succeeded = counts.get("succeeded", 0)
    return {"total": row["total"], "completed": succeeded, "failed": done - succeeded}


def _items(content: bytes) -> Iterator[BatchLine | LineError]:
    return read_lines(content.splitlines(keepends=True))


class BatchDriver:
    def __init__(self, ctx: APIContext, events: BatchEvents | None, tick_s: float = 1.0) -> None:
        self.ctx = ctx
        self.events = events
        self.tick_s = tick_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._next_purge = 0.0
        self._thread = threading.Thread(target=self._run, name="inferq-batch-driver", daemon=True)

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
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the database or broker away: try again next tick
                log.exception("batch driver: tick failed; trying again")
            self._wake.wait(self.tick_s)
            self._wake.clear()

    def tick(self) -> None:
        with self.ctx.db.begin() as conn:
            if time.monotonic() >= self._next_purge:  # files past their expires_at
                self._next_purge = time.monotonic() + PURGE_EVERY_S
                api_files.purge_expired(conn)
            found = api_batches.open_batches(conn, self.ctx.settings.topic_prefix)
        for batch in found:
            if self._stop.is_set():
                return
            with bulk_jobs.bulk_lock(self.ctx.db, batch["batch_id"]) as got:
                if got:  # else another API process is advancing it
                    self.advance(batch["batch_id"])

    # ---- one batch -------------------------------------------------------------------------------------
    def advance(self, batch_id: str) -> None:
        with self.ctx.db.connect() as conn:
            row = api_batches.get_any(conn, batch_id)
        if row is None:
            return
        now = utcnow()
        status = row["status"]
        if status in api_batches.FINISHED:
            self._publish(row)
        elif status in ("validating", "in_progress") and row["expires_at"] <= now:
            self._send_cancels(row)
            self._finalize(row, ("validating", "in_progress"), "expired", "batch_expired")
        elif status == "validating":
            self._validate(row)
        elif status == "in_progress":
            self._produce(row)
            with self.ctx.db.connect() as conn:
                row = api_batches.get_any(conn, batch_id)
            if row["status"] == "in_progress" and self._all_done(row):
                self._finalize(row, ("in_progress",), "completed", "missing")
        elif status == "finalizing":  # a process died while writing the files: write them again
            self._finalize(row, ("finalizing",), "completed", "missing")
        elif status == "cancelling":
            if row["cancels_sent_at"] is None:
                self._send_cancels(row)
            grace_over = (now - row["cancelling_at"]).total_seconds() >= CANCEL_GRACE_S
            if grace_over or self._all_done(row):
                self._finalize(row, ("cancelling",), "cancelled", "batch_cancelled")

    def _input(self, row: Row) -> bytes | None:
        with self.ctx.db.connect() as conn:
            return api_files.content(conn, row["tenant"], row["input_file_id"])

    def _validate(self, row: Row) -> None:
        content = self._input(row)
        errors: list[dict[str, Any]] = []
        total = 0
        if content is None:
            errors.append(_error("missing_file", f"input file {row['input_file_id']} no longer exists", None))
        else:
            names = ModelNames(self.ctx.db, self.ctx.models, row["tenant"])
            for item in _items(content):
                problem = self._line_problem(row, item, names)
                if problem is not None and len(errors) < MAX_ERRORS:
                    errors.append(_error(*problem))
                total += 1
            if total == 0 and not errors:
                errors.append(_error("empty_file", "the input file has no request lines", None))
        with self.ctx.db.begin() as conn:
            if errors:
                api_batches.transition(conn, row["batch_id"], ("validating",), "failed", errors=errors,
                                       failed_at=utcnow(), final_counts={"total": total, "completed": 0,
                                                                         "failed": 0})  # fmt: skip
            else:
                api_batches.transition(
                    conn,
                    row["batch_id"],
                    ("validating",),
                    "in_progress",
                    total=total,
                    in_progress_at=utcnow(),
                )
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

    def _produce(self, row: Row) -> None:
        """Hand the lines after the checkpoint to Kafka as low-priority jobs, a checkpoint at a time; stop
        when the batch left in_progress (a cancel, or its expiry)."""
        if row["submitted"] >= row["total"]:
            return
        content = self._input(row)
        if content is None:
            return
        lines = islice((i for i in _items(content) if isinstance(i, BatchLine)), row["submitted"], None)
        done = row["submitted"]
        while chunk := list(islice(lines, CHECKPOINT_LINES)):
            jobs = [self._job(line, row) for line in chunk]
            self.ctx.client.submit_many(jobs, "low")
            for job in jobs:
                self.ctx.client.forget(job.job_id)
            done += len(chunk)
            with self.ctx.db.begin() as conn:
                api_batches.update(conn, row["batch_id"], submitted=done)
                status = api_batches.get_any(conn, row["batch_id"])["status"]
            if self.ctx.settings.failpoint == KILL_AFTER_CHECKPOINT and done < row["total"]:
                log.error("failpoint %s: killing this process", KILL_AFTER_CHECKPOINT)
                os.kill(os.getpid(), signal.SIGKILL)  # tests: mid-production, its advisory lock held
            if status != "in_progress":
                return

    def _job(self, line: BatchLine, row: Row) -> JobRequest:
        """A line's job: the base unnamed, an adapter by its name (validated; if it was removed since,
        the worker refuses the job and the line is an error in the output)."""
        job = to_job(line, bulk_id=row["batch_id"], tenant=row["tenant"])
        return job.model_copy(update={"model": job_model(line.model, self.ctx.models)})

    def _job_ids(self, row: Row, content: bytes) -> Iterator[list[str]]:
        lines = (i for i in _items(content) if isinstance(i, BatchLine))
        lines = islice(lines, row["submitted"])
        while chunk := list(islice(lines, 500)):
            yield [job_id_for(row["batch_id"], line.custom_id) for line in chunk]

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
        content = self._input(row) or b""
        for ids in self._job_ids(row, content):
            with self.ctx.db.connect() as conn:
                rows = bulk_jobs.rows_for(conn, row["tenant"], ids)
            if len(rows) < len(ids) or any(r["status"] not in TERMINAL_STATUSES for r in rows.values()):
                return False
        return True

    def _send_cancels(self, row: Row) -> None:
        content = self._input(row) or b""
        for ids in self._job_ids(row, content):
            with self.ctx.db.connect() as conn:
                rows = bulk_jobs.rows_for(conn, row["tenant"], ids)
            for job_id in ids:
                found = rows.get(job_id)
                if found is None or found["status"] not in TERMINAL_STATUSES:
                    self.ctx.client.cancel(job_id, row["tenant"])
        with self.ctx.db.begin() as conn:
            api_batches.update(conn, row["batch_id"], cancels_sent_at=utcnow())

    def _finalize(self, row: Row, from_statuses: tuple[str, ...], to: str, unfinished_code: str) -> None:
        """Write the output and error files and move to `to` in one transaction: no reader sees a batch
        with half its files, and a crash before the commit leaves the batch to do again."""
        batch_id, tenant = row["batch_id"], row["tenant"]
        if to == "completed" and row["status"] == "in_progress":
            with self.ctx.db.begin() as conn:
                if not api_batches.transition(
                    conn, batch_id, ("in_progress",), "finalizing", finalizing_at=utcnow()
                ):
                    return
            from_statuses = ("finalizing",)
        content = self._input(row) or b""
        with tempfile.TemporaryDirectory(prefix="inferq-batch-") as tmp, self.ctx.db.connect() as conn:
            out, err = Path(tmp) / "output.jsonl", Path(tmp) / "errors.jsonl"
            counts = write_results(
                _items(content), batch_id, lambda ids: bulk_jobs.rows_for(conn, tenant, ids), out, err,
                unfinished_code=unfinished_code,
            )  # fmt: skip
            output, errors = out.read_bytes(), err.read_bytes()
        final = dataclasses.asdict(counts)
        request = {
            "total": sum(final.values()),
            "completed": final["succeeded"],
            "failed": final["failed"] + final["invalid"] + final["unfinished"],
        }
        lifetime = row.get("output_expires_after")  # the files live that long from their creation
        try:
            self._commit_files(batch_id, tenant, from_statuses, to, request, output, errors, lifetime)
        except _Overtaken:
            return
        log.info("batch %s: %s, %s", batch_id, to, request)
        self.wake()

    def _commit_files(
        self, batch_id: str, tenant: str, from_statuses: tuple[str, ...], to: str, request: dict[str, int],
        output: bytes, errors: bytes, lifetime_s: int | None = None,
    ) -> None:  # fmt: skip
        with self.ctx.db.begin() as conn:
            files: dict[str, Any] = {"output_file_id": None, "error_file_id": None}
            if output or not errors:
                files["output_file_id"] = api_files.create(
                    conn, tenant, "batch_output", f"{batch_id}_output.jsonl", output, lifetime_s
                )["file_id"]
            if errors:
                files["error_file_id"] = api_files.create(
                    conn, tenant, "batch_output", f"{batch_id}_error.jsonl", errors, lifetime_s
                )["file_id"]
            moved = api_batches.transition(
                conn, batch_id, from_statuses, to, final_counts=request, **files, **{f"{to}_at": utcnow()}
            )
            if not moved:  # another verdict came first (a cancel, the expiry): the files go with it
                raise _Overtaken

    def _publish(self, row: Row) -> None:
        if self.events is None:
            return
        with self.ctx.db.connect() as conn:
            batch = batch_object(row, request_counts(conn, row))
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
