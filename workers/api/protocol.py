"""Request and response shapes of OpenAI's API, as inferq answers them (no serving logic here).

Chat and completion bodies are checked and turned into jobs by the bulk path's own rules
(workers/bulk/batch_format.py), so a body means the same whether it is posted here or is a Batch line;
this module only takes out what is particular to a live request (`stream`, `stream_options`, `priority`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.topics import PRIORITY_CLASSES
from workers.api.errors import APIError

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def unix(at: datetime | None) -> int | None:
    return int(at.timestamp()) if at is not None else None


# ---- chat and completions ------------------------------------------------------------------------------
class LiveOptions(BaseModel):
    """What a live request says beyond the Batch body: streaming, and the queue's priority class."""

    stream: bool = False
    include_usage: bool = False
    priority: str = "normal"


def split_live_options(body: dict[str, Any]) -> tuple[dict[str, Any], LiveOptions]:
    """The body without its live-request fields, and those fields (refused by name when wrong)."""
    body = dict(body)
    stream = body.pop("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be a boolean", param="stream", code="invalid_value")
    stream_options = body.pop("stream_options", None) or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
        raise APIError(400, "stream_options supports only include_usage", param="stream_options")
    include_usage = stream_options.get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise APIError(400, "stream_options.include_usage must be a boolean", param="stream_options")
    priority = body.pop("priority", None) or "normal"
    if priority not in PRIORITY_CLASSES:
        raise APIError(
            400, f"priority must be one of {', '.join(PRIORITY_CLASSES)}, got {priority!r}",
            param="priority", code="invalid_value",
        )  # fmt: skip
    return body, LiveOptions(stream=stream, include_usage=include_usage, priority=priority)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens the prefix cache served."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens or 0},
    }


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


# ---- files ---------------------------------------------------------------------------------------------
FILE_PURPOSES = ("batch", "batch_output")


def file_object(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": row["file_id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": unix(row["created_at"]),
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


# ---- batches -------------------------------------------------------------------------------------------
class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=40)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(None, max_length=16)


_TIMES = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")


def batch_object(row: Mapping[str, Any], counts: Mapping[str, int]) -> dict[str, Any]:
    """OpenAI's Batch object, field for field; `counts`: request_counts (total, completed, failed); the row's
    `usage`: token sums (its jobs' so far while it runs, see batch_driver.request_counts)."""
    errors = row["errors"]
    return {
        "id": row["batch_id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": unix(row["created_at"]),
        "expires_at": unix(row["expires_at"]),
        **{f"{t}_at": unix(row[f"{t}_at"]) for t in _TIMES},
        "request_counts": dict(counts),
        "metadata": row["metadata"],
        "model": row.get("model"),
        "usage": batch_usage(row.get("usage") or {}),
    }


def batch_usage(tokens: Mapping[str, int]) -> dict[str, Any]:
    """OpenAI's Batch `usage` from token sums (prompt_tokens, completion_tokens, cached_tokens)."""
    given, made = int(tokens.get("prompt_tokens") or 0), int(tokens.get("completion_tokens") or 0)
    return {
        "input_tokens": given,
        "output_tokens": made,
        "total_tokens": given + made,
        "input_tokens_details": {"cached_tokens": int(tokens.get("cached_tokens") or 0)},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
