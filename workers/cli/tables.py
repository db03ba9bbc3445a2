"""Plain aligned text tables, the one way every verb prints rows (`jobs`, `history`, `status`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime


def cell(value: object, missing: str = "", width: int | None = None) -> str:
    """One value as text: times to the minute in UTC, floats to one decimal, cut to `width` characters."""
    if value is None:
        text = missing
    elif isinstance(value, datetime):
        text = value.astimezone(UTC).strftime("%Y-%m-%d %H:%M")
    elif isinstance(value, float):
        text = f"{value:.1f}"
    else:
        text = str(value).replace("\n", " ")
    return text if width is None or len(text) <= width else text[: width - 1] + "…"


def render(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    missing: str = "",
    width: int | None = None,
    rule: bool = True,
) -> str:
    """Columns padded to their widest cell, numbers right-aligned; a rule under the headers."""
    if not rows:
        return "(no rows)"
    cells = [[cell(v, missing, width) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    numeric = [
        all(row[i] is None or isinstance(row[i], int | float) for row in rows) for i in range(len(headers))
    ]
    lines = []
    for line in [list(headers), *cells]:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(line, widths, numeric, strict=True)]
        lines.append("  ".join(parts).rstrip())
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
