"""Output helpers shared by the benchmarks: medians, aligned text tables, JSON result files."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"  # ignored by git


def progress(message: str) -> None:
    """A timestamped line on stderr: where a long benchmark has got to."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def median(values: Iterable[float]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def fmt(value: object, digits: int = 1) -> str:
    """A table cell: numbers rounded, missing values as '-'."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], digits: int = 1) -> str:
    """A plain-text table; the first column is left-aligned, the others right-aligned."""
    cells = [list(headers)] + [[fmt(value, digits) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [row[0].ljust(widths[0])] + [
            cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def default_json_path(kind: str) -> Path:
    return RESULTS_DIR / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def write_json(path: Path, payload: dict[str, object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_finite(payload), indent=2, sort_keys=True, allow_nan=False, default=_jsonable)
    path.write_text(text + "\n")
    return path


def _finite(value: object) -> object:
    """NaN and infinities become null: strict JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _jsonable(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
