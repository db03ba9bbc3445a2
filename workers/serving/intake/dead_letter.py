"""The dead-letter message of a refused record: its bytes as they came, and why, in headers."""

from __future__ import annotations

from workers.serving.intake.rejected import Rejected

MAX_KEY_BYTES = 4096
MAX_ERROR_BYTES = 4000


def dead_letter_message(r: Rejected, max_bytes: int) -> tuple[bytes | None, bytes, list[tuple[str, bytes]]]:
    """(key, value, headers): the value cut to what the broker accepts, `truncated` saying so."""
    rec = r.record
    value = rec.value or b""
    headers = [
        ("source_topic", rec.topic.encode()),
        ("source_partition", str(rec.partition).encode()),
        ("source_offset", str(rec.offset).encode()),
        ("error", r.error.encode()[:MAX_ERROR_BYTES]),
        ("reason", r.reason.encode()),
        ("original_size", str(len(value)).encode()),
        ("truncated", b"true" if len(value) > max_bytes else b"false"),
    ]
    if rec.last_offset > rec.offset:  # a record batch that could not be decoded stands for its range
        headers.append(("source_last_offset", str(rec.last_offset).encode()))
    key = rec.key[:MAX_KEY_BYTES] if rec.key else rec.key
    return key, value[:max_bytes], headers
