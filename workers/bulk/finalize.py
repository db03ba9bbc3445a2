"""Writing a bulk job's output and errors files in input order, a chunk of lines at a time."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from workers.bulk.batch_format import BatchLine, LineError, job_id_for
from workers.bulk.output import Row, error_line, failed_line, invalid_line, success_line

# job_ids → their rows (terminal or not); ids without a row are left out of the answer.
RowLookup = Callable[[list[str]], dict[str, Row]]


@dataclass(frozen=True)
class FinalCounts:
    succeeded: int
    failed: int  # jobs that ended in another terminal status
    invalid: int  # lines that never became jobs
    unfinished: int  # valid lines whose job had no terminal row (a cancelled bulk job)


def _chunks(items: Iterable[BatchLine | LineError], size: int) -> Iterator[list[BatchLine | LineError]]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def refused_by_worker(row: Row | None) -> bool:
    """A job the worker refused before it ever ran (attempts 0: never admitted), for what only the model
    can tell (a logit_bias id past its vocabulary, a prompt past its context, a grammar it cannot use):
    an invalid line, as `inferq run-batch` reports it, not a failed request."""
    return row is not None and row["status"] == "rejected" and not row.get("attempts")


def write_results(
    items: Iterable[BatchLine | LineError],
    bulk_id: str,
    lookup: RowLookup,
    output: Path,
    errors: Path,
    *,
    unfinished_code: str = "cancelled",
    chunk: int = 500,
    model_name: str | None = None,
) -> FinalCounts:
    """Write both files atomically (temp file, then rename), so a re-run after a crash starts clean."""
    tmp_out, tmp_err = output.with_suffix(".tmp"), errors.with_suffix(".err.tmp")
    with open(tmp_out, "w", encoding="utf-8") as out, open(tmp_err, "w", encoding="utf-8") as err:
        counts = write_lines(
            items, bulk_id, lookup, out.write, err.write, unfinished_code=unfinished_code, chunk=chunk,
            model_name=model_name,
        )  # fmt: skip
        for f in (out, err):
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp_out, output)
    os.replace(tmp_err, errors)
    return counts


def write_lines(
    items: Iterable[BatchLine | LineError],
    bulk_id: str,
    lookup: RowLookup,
    output: Callable[[str], object],
    errors: Callable[[str], object],
    *,
    unfinished_code: str = "cancelled",
    chunk: int = 500,
    model_name: str | None = None,
) -> FinalCounts:
    """The output and error lines of `items` in input order, handed to `output` and `errors` as text (one
    JSON line each, newline included), `chunk` lines' rows looked up at a time: what is held is one chunk."""
    counts = {"succeeded": 0, "failed": 0, "invalid": 0, "unfinished": 0}
    for part in _chunks(items, chunk):
        ids = [job_id_for(bulk_id, i.custom_id) for i in part if isinstance(i, BatchLine)]
        rows = lookup(ids) if ids else {}
        for item in part:
            if isinstance(item, LineError):
                counts["invalid"] += 1
                record, target = invalid_line(item), errors
            else:
                job_id = job_id_for(bulk_id, item.custom_id)
                row = rows.get(job_id)
                status = row["status"] if row else None
                if refused_by_worker(row):
                    counts["invalid"] += 1
                    message = f"line {item.line_no}: {row.get('error') or 'refused by the worker'}"
                    record, target = invalid_line(LineError(item.line_no, item.custom_id, message)), errors
                elif status == "succeeded":
                    counts["succeeded"] += 1
                    record, target = success_line(item, row, model_name), output
                elif status in ("failed", "rejected", "cancelled", "expired"):
                    counts["failed"] += 1
                    record, target = failed_line(item, row), errors
                else:
                    counts["unfinished"] += 1
                    message = f"job {status or 'never started'} when the bulk job ended"
                    record, target = error_line(item.custom_id, item.line_no, unfinished_code, message,
                                                job_id), errors  # fmt: skip
            target(json.dumps(record, ensure_ascii=False) + "\n")
    return FinalCounts(**counts)
