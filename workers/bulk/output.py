"""OpenAI Batch output lines from jobs rows: successes for the output file, the rest for the errors file."""

from __future__ import annotations

import codecs
from datetime import datetime
from typing import Any

from workers.bulk.batch_format import BatchLine, LineError
from workers.db.bulk_jobs import Row
from workers.db.outbox import choices_of


def _created(row: Row) -> int:
    """When the request was made (as OpenAI's `created`): the job's post, else its end."""
    at = row.get("created_at") or row.get("finished_at")
    return int(at.timestamp()) if isinstance(at, datetime) else 0


def usage_body(row: Row) -> dict[str, Any]:
    """OpenAI's usage of a job's row, with the prompt tokens its prefix cache served."""
    prompt, completion = row.get("prompt_tokens") or 0, row.get("completion_tokens") or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": row.get("cached_tokens") or 0},
    }


def completion_logprobs(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    """The completions API's logprobs from the chat shape the row stores (`{"content": [entries]}`):
    parallel lists, each top list a {token: logprob} map, and each token's character offset in the text."""
    if chat is None:
        return None
    entries = chat["content"]
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": text_offsets(entries),
    }


def text_offsets(entries: list[dict[str, Any]]) -> list[int]:
    """Where each token starts in the text, in characters of the text as emitted: every piece of a
    character split over tokens starts where the character does, and it counts once (each piece's
    `token` is U+FFFD: counting those would run past the text). From the exact `bytes`, decoded as the
    detokenizer does; an entry without them counts its `token`."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        raw = e.get("bytes")
        if raw is None:
            at += len(e["token"])
            continue
        at += len(decoder.decode(bytes(raw)))
    return offsets


def _message(choice: dict[str, Any]) -> dict[str, Any]:
    """A choice as OpenAI's assistant message: with its tool calls, if it made any (its content is then
    null unless it wrote text beside them)."""
    calls = choice.get("tool_calls")
    if not calls:
        return {"role": "assistant", "content": choice["text"]}
    return {"role": "assistant", "content": choice["text"] or None, "tool_calls": calls}


def response_body(line: BatchLine, row: Row, model_name: str | None = None) -> dict[str, Any]:
    """The body OpenAI's endpoint would have returned for this request, every sample a choice; `model`
    is the adapter's name when one served it (the row's model is the one the request named), else the
    served model's name when known (as vLLM answers), else the name the request gave."""
    if line.model is not None and row.get("model") == line.model:
        model_name = line.model
    stored = choices_of(row.get("output_text") or "", row.get("finish_reason"), row.get("choices"))
    if line.url == "/v1/chat/completions":
        kind = "chat.completion"
        choices = [
            {
                "index": c["index"],
                "message": _message(c),
                "logprobs": c["logprobs"],
                "finish_reason": c["finish_reason"],
            }
            for c in stored
        ]
    else:
        kind = "text_completion"
        choices = [
            {
                "index": c["index"],
                "text": c["text"],
                "logprobs": completion_logprobs(c["logprobs"]),
                "finish_reason": c["finish_reason"],
            }
            for c in stored
        ]
    return {
        "id": row["job_id"],
        "object": kind,
        "created": _created(row),
        "model": model_name or line.model,
        "choices": choices,
        "usage": usage_body(row),
    }


def success_line(line: BatchLine, row: Row, model_name: str | None = None) -> dict[str, Any]:
    body = response_body(line, row, model_name)
    return {
        "id": f"batch_req_{row['job_id']}",
        "custom_id": line.custom_id,
        "response": {"status_code": 200, "request_id": row["job_id"], "body": body},
        "error": None,
    }


def error_line(
    custom_id: str | None, line_no: int, code: str, message: str, job_id: str | None = None
) -> dict:
    return {
        "id": f"batch_req_{job_id}" if job_id else None,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message, "line": line_no},
    }


def invalid_line(item: LineError) -> dict[str, Any]:
    return error_line(item.custom_id, item.line_no, "invalid_request", item.message)


def failed_line(line: BatchLine, row: Row) -> dict[str, Any]:
    """A job that ended in failed/rejected/cancelled/expired: its status is the code."""
    message = row.get("error") or f"job {row['status']}"
    return error_line(line.custom_id, line.line_no, row["status"], message, row["job_id"])
