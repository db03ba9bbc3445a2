"""Turning raw Kafka bytes into a JobRequest, or a clear reason why not."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import ValidationError

from schemas.jobs import CancelRequest, JobRequest


class InvalidMessage(ValueError):
    """A message that can never be processed; the reason goes to the DLQ headers and the jobs row."""


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 1_000_000
    max_prompt_bytes: int = 256_000
    max_tokens: int = 4096  # cap on a job's max_tokens
    default_max_tokens: int = 128  # for a job that names none (never above the cap)
    max_stop: int = 8  # stop strings per job
    max_stop_bytes: int = 256  # per stop string
    max_metadata_bytes: int = 16_000


def _decode(value: bytes | None, limits: Limits) -> object:
    if value is None:
        raise InvalidMessage("empty message (tombstone)")
    if len(value) > limits.max_message_bytes:
        raise InvalidMessage(f"message is {len(value)} bytes; the limit is {limits.max_message_bytes}")
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidMessage(f"message is not valid UTF-8: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidMessage(f"message is not JSON: {exc}") from None


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "message"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def _check_limits(job: JobRequest, limits: Limits) -> None:
    prompt_bytes = len(job.prompt.encode()) if job.prompt is not None else 0
    if job.messages is not None:
        prompt_bytes = sum(len(m.content.encode()) for m in job.messages)
    if prompt_bytes > limits.max_prompt_bytes:
        raise InvalidMessage(f"prompt is {prompt_bytes} bytes; the limit is {limits.max_prompt_bytes}")
    if job.max_tokens is not None and job.max_tokens > limits.max_tokens:
        raise InvalidMessage(f"max_tokens {job.max_tokens} is over the limit {limits.max_tokens}")
    if len(job.stop) > limits.max_stop:
        raise InvalidMessage(f"{len(job.stop)} stop strings; at most {limits.max_stop}")
    if any(len(s.encode()) > limits.max_stop_bytes for s in job.stop):
        raise InvalidMessage(f"a stop string is longer than {limits.max_stop_bytes} bytes")
    if len(json.dumps(job.metadata)) > limits.max_metadata_bytes:
        raise InvalidMessage(f"metadata is over {limits.max_metadata_bytes} bytes")


def parse_job(value: bytes | None, limits: Limits) -> JobRequest:
    data = _decode(value, limits)
    if not isinstance(data, dict):
        raise InvalidMessage(f"message must be a JSON object, got {type(data).__name__}")
    try:
        job = JobRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidMessage(_explain(exc)) from None
    _check_limits(job, limits)
    return job


def parse_control(value: bytes | None, limits: Limits) -> CancelRequest:
    data = _decode(value, limits)
    try:
        return CancelRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidMessage(_explain(exc)) from None


def peek_job_id(value: bytes | None) -> str | None:
    """Best-effort job_id of a message that failed validation, so its rejection can be recorded."""
    try:
        data = json.loads(value or b"")
    except (ValueError, UnicodeDecodeError):
        return None
    job_id = data.get("job_id") if isinstance(data, dict) else None
    if isinstance(job_id, str) and 0 < len(job_id) <= 128:
        return job_id
    return None
