"""OpenAI Batch input lines → JobRequests, with line-numbered errors; read one line at a time.

A line: {"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body": {...}}.
Validation is deterministic, so the producer and the finaliser re-read the file and reach the same
verdict per line as `bulk submit` did, without anything stored per line.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.jobs import JobRequest
from schemas.validation import InvalidMessage, Limits, parse_job
from workers.bulk.batch_fields import CHAT_OPTIONS, OPTIONS, check_body
from workers.serving.intake.sampling import constraint_field, grammar_spec

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
MAX_CUSTOM_ID = 512
_JOB_ID_SAFE = re.compile(r"^[A-Za-z0-9._:@/+=-]+$")  # schemas.jobs.JobRequest.job_id's pattern


@dataclass(frozen=True)
class BatchLine:
    """A valid input line."""

    line_no: int  # 1-based
    custom_id: str
    url: str
    model: str | None
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError:
    """An invalid input line; custom_id when one could be read."""

    line_no: int
    custom_id: str | None
    message: str


def job_id_for(bulk_id: str, custom_id: str) -> str:
    """Deterministic, so a re-run of the producer sends the same job_ids and the worker skips finished ones.

    Readable when the custom_id fits the job_id alphabet and length; otherwise a digest of it ('=' marks it).
    """
    job_id = f"{bulk_id}:{custom_id}"
    if len(job_id) <= 128 and _JOB_ID_SAFE.match(custom_id) and not custom_id.startswith("="):
        return job_id
    return f"{bulk_id}:={hashlib.sha256(custom_id.encode()).hexdigest()[:40]}"


def to_job(line: BatchLine, *, bulk_id: str, tenant: str) -> JobRequest:
    """The JobRequest a valid line becomes (raises InvalidMessage for what the worker would reject)."""
    body = line.body
    fields: dict[str, Any] = {
        "job_id": job_id_for(bulk_id, line.custom_id),
        "tenant": tenant,
        "bulk_id": bulk_id,
        "metadata": {"custom_id": line.custom_id},
        "stream": False,  # its result is what is read: token events would only cost the broker and workers
    }
    if line.model is not None:  # the base (one of its names) or an adapter: the worker decides which
        fields["model"] = line.model
    if line.url == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise InvalidMessage("body.prompt must be a string (or a list of exactly one string)", "prompt")
        fields["prompt"] = prompt
    else:
        fields["messages"] = [_message(m, i) for i, m in enumerate(_list(body.get("messages"), "messages"))]
        fields.update({key: body[key] for key in CHAT_OPTIONS if body.get(key) is not None})
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    for key in ("temperature", "top_p", "top_k", "seed", *OPTIONS):
        if body.get(key) not in (None, {}, {"type": "text"}):  # an empty bias, plain text: the defaults
            fields[key] = body[key]
    fields.update(_logprobs(line.url, body))
    stop = body.get("stop")
    if stop is not None:
        fields["stop"] = [stop] if isinstance(stop, str) else stop
    # parse_job is what the worker runs on the Kafka message: a line accepted here is accepted there.
    return parse_job(json.dumps(fields).encode(), Limits())


def _logprobs(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The job's logprobs/top_logprobs from either API's spelling."""
    given = body.get("logprobs")
    if url == "/v1/completions":  # a count of top log probabilities; null or false: none
        if given is None or given is False:
            return {}
        if type(given) is not int or not 0 <= given <= 20:
            raise InvalidMessage(f"body.logprobs must be an integer 0-20 or null, got {given!r}", "logprobs")
        return {"logprobs": True, "top_logprobs": given}
    top = body.get("top_logprobs")
    if given is not True and top == 0:  # `"top_logprobs": 0` beside no logprobs asks for nothing
        top = None
    return {k: v for k, v in (("logprobs", given), ("top_logprobs", top)) if v is not None}


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise InvalidMessage(f"body.{name} must be a non-empty list", name)
    return value


# A message's fields beyond role, content and the tool fields: `name` (a participant's name) and
# `annotations` (of an earlier answer) are taken and not shown to the model; `refusal`, `audio` and the
# deprecated `function_call`, which an earlier answer sent back as it came carries as null, only as null.
_MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name", "annotations"}
_NULL_ONLY = ("refusal", "audio", "function_call")


def _message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidMessage(f"body.{where} must be an object with 'role' and 'content'", where)
    unknown = sorted(set(message) - _MESSAGE_KEYS - set(_NULL_ONLY))
    if unknown:
        raise InvalidMessage(
            f"body.{where}: unsupported fields {', '.join(unknown)}", f"{where}.{unknown[0]}"
        )
    for key in _NULL_ONLY:
        if message.get(key) is not None:
            raise InvalidMessage(f"body.{where}.{key} is not supported (only null)", f"{where}.{key}")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):  # fmt: skip
            raise InvalidMessage(f"body.{where}.content: only text parts are supported", f"{where}.content")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise InvalidMessage(f"body.{where}.content must be a string", f"{where}.content")
    kept = {"role": message.get("role"), "content": content}
    kept.update({k: message[k] for k in ("tool_calls", "tool_call_id") if message.get(k) is not None})
    return kept


def _check_envelope(data: Any) -> tuple[str, str, dict[str, Any]]:
    if not isinstance(data, dict):
        raise InvalidMessage("a line must be a JSON object")
    unknown = set(data) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise InvalidMessage(f"unknown fields: {', '.join(sorted(unknown))}")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise InvalidMessage(f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters")
    if data.get("method") != "POST":
        raise InvalidMessage('method must be "POST"')
    url = data.get("url")
    if url not in ENDPOINTS:
        raise InvalidMessage(f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    body = data.get("body")
    if not isinstance(body, dict):
        raise InvalidMessage("body must be a JSON object")
    problem = check_body(url, body)
    if problem is not None:
        raise InvalidMessage(problem[1], problem[0])
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise InvalidMessage("body.model must be a string", "model")
    return custom_id, url, body


def parse_line(raw: str, line_no: int) -> BatchLine | LineError:
    custom_id = None
    try:
        data = json.loads(raw)
        if isinstance(data, dict) and isinstance(data.get("custom_id"), str):
            custom_id = data["custom_id"]
        custom_id, url, body = _check_envelope(data)
        line = BatchLine(line_no, custom_id, url, body.get("model"), body)
        checked_job(line, bulk_id="check", tenant="check")
    except json.JSONDecodeError as exc:
        return LineError(line_no, None, f"line {line_no}: not JSON: {exc.msg} (column {exc.colno})")
    except InvalidMessage as exc:
        return LineError(line_no, custom_id, f"line {line_no}: {exc}")
    return line


def checked_job(line: BatchLine, *, bulk_id: str, tenant: str) -> JobRequest:
    """`to_job`, and the output constraint checked as the worker's compiler would (InvalidMessage if not)."""
    job = to_job(line, bulk_id=bulk_id, tenant=tenant)
    _check_constraint(job)
    return job


def _check_constraint(job: JobRequest) -> None:
    """A schema or regex the worker's compiler would refuse makes the line invalid here, with the worker's
    reason, rather than a job that is `rejected` once it reaches a worker. (What needs the model, say a
    logit_bias id past its vocabulary, is found by the worker: finalize reports it as an invalid line too.)"""
    spec = grammar_spec(job)
    if spec is None:
        return
    from gpu.grammar import GrammarError
    from gpu.grammar.compiler import precheck  # loads xgrammar: only for lines that carry a constraint

    try:
        precheck(spec)
    except GrammarError as exc:
        field = constraint_field(spec)
        raise InvalidMessage(f"{field} cannot be compiled: {exc}", field) from None


def read_batch(path: Path) -> Iterator[BatchLine | LineError]:
    """Every non-blank line of the file in order; a repeated custom_id is an error on its later lines.

    Only the custom_ids seen so far are kept (as digests), never the lines.
    """
    with open(path, "rb") as f:
        yield from read_lines(f)


def read_lines(raw_lines: Iterable[bytes]) -> Iterator[BatchLine | LineError]:
    """`read_batch` over lines from anywhere (a file's content held in PostgreSQL, for the HTTP API)."""
    seen: set[bytes] = set()
    for line_no, raw_bytes in enumerate(raw_lines, start=1):
        if not raw_bytes.strip():
            continue
        try:
            item = parse_line(raw_bytes.decode("utf-8"), line_no)
        except UnicodeDecodeError as exc:
            item = LineError(
                line_no, None, f"line {line_no}: not valid UTF-8 ({exc.reason} at byte {exc.start})"
            )
        if isinstance(item, BatchLine):
            digest = hashlib.blake2b(item.custom_id.encode(), digest_size=16).digest()
            if digest in seen:
                item = LineError(
                    line_no, item.custom_id, f"line {line_no}: duplicate custom_id {item.custom_id!r}"
                )
            seen.add(digest)
        yield item


@dataclass(frozen=True)
class Summary:
    total: int
    invalid: int
    endpoint: str | None  # the one endpoint of the valid lines, or "mixed"
    errors: tuple[LineError, ...]  # the first few, for the submitter's message


def summarize(path: Path, keep_errors: int = 20) -> Summary:
    total = invalid = 0
    endpoints: set[str] = set()
    errors: list[LineError] = []
    for item in read_batch(path):
        total += 1
        if isinstance(item, LineError):
            invalid += 1
            if len(errors) < keep_errors:
                errors.append(item)
        else:
            endpoints.add(item.url)
    endpoint = endpoints.pop() if len(endpoints) == 1 else ("mixed" if endpoints else None)
    return Summary(total, invalid, endpoint, tuple(errors))
