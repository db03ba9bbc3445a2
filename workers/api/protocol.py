"""Request and response shapes of OpenAI's API, as inferq answers them (no serving logic here).

Chat and completion bodies are checked and turned into jobs by the bulk path's own rules
(workers/bulk/batch_format.py), so a body means the same whether it is posted here or is a Batch line;
this module only takes out what is particular to a live request (`stream`, `stream_options`, `priority`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.topics import PRIORITY_CLASSES
from workers.api.errors import APIError
from workers.bulk.batch_fields import FIELDS, Kind

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# What a live request says beyond a Batch line's body: all honoured (`priority` is inferq's extension)
LIVE_FIELDS = ("stream", "stream_options", "priority")
STREAM_OPTIONS = ("include_usage", "include_obfuscation")


def field_kinds(url: str) -> dict[str, Kind]:
    """What the endpoint does with each body field (docs/api.md's table; tests/api/test_api_fields.py)."""
    kinds = {name: rule.kind for name, rule in FIELDS[url].items()}
    return {**kinds, **dict.fromkeys(LIVE_FIELDS, "honoured")}


def body_param(url: str, body: dict[str, Any], param: str | None) -> str | None:
    """The body field a job field's error is about (`param`): the job's `max_tokens` is the body's
    `max_completion_tokens` when it says that, the completions API's `logprobs` is the job's top_logprobs."""
    if param is None:
        return None
    head, sep, rest = param.partition(".")
    if head == "max_tokens" and "max_completion_tokens" in body:
        head = "max_completion_tokens"
    elif head == "top_logprobs" and url == COMPLETIONS:
        head = "logprobs"
    return head + sep + rest


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
    stream_options = body.pop("stream_options", None)
    stream_options = {} if stream_options is None else stream_options
    if not isinstance(stream_options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options", code="invalid_value")
    unknown = sorted(set(stream_options) - set(STREAM_OPTIONS))
    if unknown:
        raise APIError(
            400, f"stream_options supports {' and '.join(STREAM_OPTIONS)}, not {', '.join(unknown)}",
            param=f"stream_options.{unknown[0]}", code="invalid_value",
        )  # fmt: skip
    for name in STREAM_OPTIONS:  # include_obfuscation: taken, and no chunk carries `obfuscation` padding
        if not isinstance(stream_options.get(name, False), bool | None):
            raise APIError(400, f"stream_options.{name} must be a boolean", param=f"stream_options.{name}",
                           code="invalid_value")  # fmt: skip
    include_usage = stream_options.get("include_usage") or False
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
# The upload form's fields (files.create) and what inferq does with each (docs/api.md's table)
FILE_FIELDS: dict[str, Kind] = {"file": "honoured", "purpose": "partly", "expires_after": "honoured"}


def check_file_form(keys: Iterable[str]) -> None:
    """Refuse a form field files.create does not have, naming it (`expires_after[...]` is expires_after)."""
    for key in keys:
        name = key.split("[", 1)[0]
        if name not in FILE_FIELDS:
            raise APIError(400, f"Unsupported form field {key!r}", param=name, code="invalid_value")


EXPIRY_S = (3600, 30 * 24 * 3600)  # OpenAI's bounds of a file's lifetime: an hour to 30 days


class ExpiresAfter(BaseModel):
    """`expires_after` of an upload, `output_expires_after` of a batch: seconds from the file's creation."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=EXPIRY_S[0], le=EXPIRY_S[1], strict=True)


def upload_lifetime(form: Mapping[str, Any]) -> int | None:
    """The seconds an upload lives: `expires_after` of its multipart form, as the SDK sends it
    (`expires_after[anchor]`, `expires_after[seconds]`); None when it gives none (it never expires)."""
    given = {
        key.removeprefix("expires_after[").removesuffix("]"): value
        for key, value in form.items()
        if key.startswith("expires_after[") and key.endswith("]")
    }
    if not given:
        return None
    seconds = given.get("seconds")
    if isinstance(seconds, str) and seconds.strip().isdigit():
        given["seconds"] = int(seconds)
    try:
        return ExpiresAfter.model_validate(given).seconds
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(["expires_after", *(str(p) for p in first["loc"])])
        raise APIError(400, f"{param}: {first['msg']}", param=param, code="invalid_value") from None


def file_object(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": row["file_id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": unix(row["created_at"]),
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "expires_at": unix(row.get("expires_at")),
        "status_details": None,
    }


# ---- batches -------------------------------------------------------------------------------------------
class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=40)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: ExpiresAfter | None = None  # the output and error files' lifetime


# batches.create's fields and what inferq does with each (docs/api.md's table): BatchCreate's own
BATCH_FIELDS: dict[str, Kind] = {
    "input_file_id": "honoured",
    "endpoint": "partly",  # chat completions and completions; the SDK's other endpoints are refused
    "completion_window": "honoured",
    "metadata": "honoured",
    "output_expires_after": "honoured",
}


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
