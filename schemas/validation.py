"""Turning raw Kafka bytes into a JobRequest, or a clear reason why not.

Everything a record can carry that a later stage would choke on is refused here, with a reason a
producer can act on: bytes that are not UTF-8 or not JSON, `NaN`/`Infinity`, numbers too large to
handle, nesting deeper than any real job needs, NUL characters (PostgreSQL text and jsonb cannot
store U+0000) and lone surrogates (JSON's `"\ud800"` escape decodes to a code point UTF-8 cannot encode;
the driver or the server refuses it). Such a job could never be recorded, and a statement that fails on
it would fail for every job admitted with it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pydantic import ValidationError

from schemas.jobs import (
    MAX_CHOICE_BYTES,
    MAX_CHOICES,
    MAX_N,
    MAX_REGEX_BYTES,
    CancelRequest,
    FieldError,
    JobRequest,
)

# What no string of a job may hold: U+0000, and U+D800-U+DFFF, which after JSON decoding (a valid pair of
# escapes becomes one code point) can only be a lone surrogate.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


class InvalidMessage(ValueError):
    """A message that can never be processed; the reason goes to the DLQ headers and the jobs row.
    `param`: the field at fault, when one is (`messages[2].content`, `tool_choice`), as OpenAI names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 1_000_000
    max_prompt_bytes: int = 256_000
    # A deployment's cap on a job's max_tokens (a job asking for more is refused; one naming none gets up
    # to it). None, the default: no cap but the model's context (prompt + max_tokens <= max_model_len),
    # and a job naming no max_tokens generates up to the context left, as OpenAI's and vLLM's do.
    max_tokens: int | None = None
    max_stop: int = 8  # stop strings per job
    max_stop_bytes: int = 256  # per stop string
    max_metadata_bytes: int = 16_000
    max_depth: int = 32  # nesting of JSON objects and arrays (metadata is the only free-form part)
    max_timeout_s: float = 7 * 24 * 3600.0
    # A dead-lettered payload is cut to this many bytes so the broker accepts it (its default
    # message.max.bytes is 1 MiB); the original size travels in a header.
    dlq_max_bytes: int = 900_000
    # Control tokens spelt in user text (`<|im_start|>`) stay plain text unless an operator allows them.
    special_tokens_in_text: bool = False
    max_n: int = MAX_N  # samples per job (no higher than the message schema's)
    # Output constraints: compiling one costs the intake thread time (and the engine's cache memory)
    # growing with its size, so their sizes are bounded like a prompt's. A schema's nesting is bounded
    # by max_depth, as every part of a message.
    max_schema_bytes: int = 32_000  # response_format.json_schema.schema as compact JSON
    max_regex_bytes: int = MAX_REGEX_BYTES
    max_choices: int = MAX_CHOICES
    max_choice_bytes: int = MAX_CHOICE_BYTES  # per choice
    # Log probabilities are stored with the row and published with the result: n x max_tokens x
    # (top_logprobs + 1) entries (~60 bytes each) at most, so one job's row stays a few MB.
    max_logprob_entries: int = 100_000


def _reject_constant(name: str) -> float:
    raise InvalidMessage(f"message contains {name}, which is not a finite number")


def _unstorable(text: str) -> str | None:
    """Why `text` cannot be stored, or None."""
    found = _UNSTORABLE.search(text)
    if found is None:
        return None
    if found.group() == "\x00":
        return "a NUL character (U+0000), which cannot be stored"
    return f"a lone surrogate (U+{ord(found.group()):04X}), which is not valid Unicode and cannot be stored"


def _depth_and_text(data: object, limits: Limits) -> None:
    """Refuse nesting deeper than the limit and any string (or key) that cannot be stored; iterative."""
    stack: list[tuple[object, int, str]] = [(data, 1, "message")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            if why := _unstorable(value):
                raise InvalidMessage(f"{where} contains {why}", _where_param(where))
        elif isinstance(value, dict | list):
            if depth > limits.max_depth:
                raise InvalidMessage(
                    f"message is nested deeper than {limits.max_depth} levels",
                    _where_param(where.split(".")[0]),
                )
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                # checked before the key is named in any reason: the reason is stored too
                if isinstance(key, str) and (why := _unstorable(key)):
                    raise InvalidMessage(f"a key in {where} contains {why}")
                name = f"{where}.{key}" if where != "message" else str(key)
                stack.append((item, depth + 1, name))


def _where_param(where: str) -> str | None:
    """`messages.0.content` as OpenAI's `param` writes it (`messages[0].content`); None for the message."""
    return None if where == "message" else re.sub(r"\.(\d+)", r"[\1]", where)


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
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise InvalidMessage(f"message is not JSON: {exc}") from None
    except RecursionError:
        raise InvalidMessage(f"message is nested deeper than {limits.max_depth} levels") from None
    except ValueError as exc:  # e.g. an integer literal longer than Python's digit limit
        if isinstance(exc, InvalidMessage):
            raise
        raise InvalidMessage(f"message is not usable JSON: {exc}") from None
    if _may_be_deep_or_unstorable(text, limits):
        _depth_and_text(data, limits)
    return data


def _may_be_deep_or_unstorable(text: str, limits: Limits) -> bool:
    """Whether the walk of `_depth_and_text` can find anything in this JSON text. A string can hold a NUL or a
    lone surrogate only through a \\u escape (valid UTF-8 has no surrogates; JSON, no raw control
    characters), and a value nested N levels deep needs N opening brackets: a message with no escape and no
    more brackets than the limit (most of them) skips a walk that cost a tenth of the intake's time."""
    return "\\u" in text or text.count("{") + text.count("[") > limits.max_depth


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        cause = (err.get("ctx") or {}).get("error")
        where = ".".join(
            [*(str(p) for p in err["loc"]), *([cause.field] if isinstance(cause, FieldError) else [])]
        )
        parts.append(f"{where or 'message'}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _param(exc: ValidationError) -> str | None:
    """The field the first error is about, as OpenAI's `param` names one (`messages[0].content`): its
    location up to the first part that is no field name (a union's member), or the field a check across
    fields named (FieldError)."""
    err = exc.errors(include_url=False)[0]
    cause = (err.get("ctx") or {}).get("error")
    param = ""
    for part in err["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif _NAME.match(part):
            param += f".{part}" if param else part
        else:
            break
    if isinstance(cause, FieldError):
        param = f"{param}.{cause.field}" if param else cause.field
    return param or None


def _prompt_bytes(job: JobRequest) -> int:
    """What the job puts in the prompt: its text, earlier turns' calls, and its tools' definitions."""
    if job.prompt is not None:
        return len(job.prompt.encode())
    size = 0
    for m in job.messages or ():
        size += len((m.content or "").encode())
        size += sum(len(c.function.arguments.encode()) + len(c.function.name) for c in m.tool_calls or ())
    if job.tools:
        size += len(json.dumps([t.model_dump(exclude_none=True) for t in job.tools]).encode())
    return size


def _check_limits(job: JobRequest, limits: Limits) -> None:
    prompt_bytes = _prompt_bytes(job)
    if prompt_bytes > limits.max_prompt_bytes:
        raise InvalidMessage(
            f"prompt is {prompt_bytes} bytes; the limit is {limits.max_prompt_bytes}",
            "prompt" if job.prompt is not None else "messages",
        )
    if job.max_tokens is not None and limits.max_tokens is not None and job.max_tokens > limits.max_tokens:
        raise InvalidMessage(
            f"max_tokens {job.max_tokens} is over the limit {limits.max_tokens}", "max_tokens"
        )
    if job.timeout_s is not None and job.timeout_s > limits.max_timeout_s:
        raise InvalidMessage(
            f"timeout_s {job.timeout_s:g} is over the limit {limits.max_timeout_s:g}", "timeout_s"
        )
    if len(job.stop) > limits.max_stop:
        raise InvalidMessage(f"{len(job.stop)} stop strings; at most {limits.max_stop}", "stop")
    if any(len(s.encode()) > limits.max_stop_bytes for s in job.stop):
        raise InvalidMessage(f"a stop string is longer than {limits.max_stop_bytes} bytes", "stop")
    if len(json.dumps(job.metadata)) > limits.max_metadata_bytes:
        raise InvalidMessage(f"metadata is over {limits.max_metadata_bytes} bytes", "metadata")
    _check_generation_options(job, limits)


def _check_generation_options(job: JobRequest, limits: Limits) -> None:
    if job.n > limits.max_n:
        raise InvalidMessage(f"n {job.n} is over the limit {limits.max_n}", "n")
    fmt = job.response_format
    if fmt is not None and fmt.type == "json_schema":
        size = len(json.dumps(fmt.json_schema.json_schema, separators=(",", ":")).encode())
        if size > limits.max_schema_bytes:
            raise InvalidMessage(
                f"response_format.json_schema.schema is {size} bytes; the limit is {limits.max_schema_bytes}",
                "response_format",
            )
    for i, tool in enumerate(job.tools or ()):  # a forced call compiles its schema as response_format's is
        size = len(json.dumps(tool.function.arguments_schema, separators=(",", ":")).encode())
        if size > limits.max_schema_bytes:
            raise InvalidMessage(
                f"tools[{i}].function.parameters is {size} bytes; the limit is {limits.max_schema_bytes}",
                f"tools[{i}].function.parameters",
            )
    if job.guided_regex is not None and len(job.guided_regex.encode()) > limits.max_regex_bytes:
        raise InvalidMessage(f"guided_regex is over {limits.max_regex_bytes} bytes", "guided_regex")
    if job.guided_choice is not None:
        if len(job.guided_choice) > limits.max_choices:
            raise InvalidMessage(
                f"{len(job.guided_choice)} guided_choice entries; at most {limits.max_choices}",
                "guided_choice",
            )
        if any(len(c.encode()) > limits.max_choice_bytes for c in job.guided_choice):
            raise InvalidMessage(
                f"a guided_choice entry is longer than {limits.max_choice_bytes} bytes", "guided_choice"
            )
    max_tokens = job.max_tokens or limits.max_tokens  # none named: the context decides (logprob_room)
    if job.logprobs_k is not None and max_tokens is not None:
        entries = job.n * max_tokens * (job.logprobs_k + 1)
        if entries > limits.max_logprob_entries:
            raise InvalidMessage(
                f"n x max_tokens x (top_logprobs + 1) is {entries} log probabilities; "
                f"the limit is {limits.max_logprob_entries}",
                "top_logprobs" if job.logprobs_k else "logprobs",
            )


def check_tenant(tenant: str) -> str:
    """`tenant` if a job may name it (JobRequest.tenant's rule, and storable); InvalidMessage otherwise.
    What makes API keys, whose tenant every request of theirs posts as, refuse a name no job could carry."""
    try:
        JobRequest.model_validate({"tenant": tenant, "prompt": "x"})
    except ValidationError as exc:
        raise InvalidMessage(f"tenant {tenant[:140]!r}: {_explain(exc).removeprefix('tenant: ')}") from None
    if why := _unstorable(tenant):
        raise InvalidMessage(f"tenant contains {why}")
    return tenant


def logprob_room(job: JobRequest, limits: Limits) -> int | None:
    """The most tokens a job that asked for log probabilities may generate so that they stay within
    `max_logprob_entries` (None: it asked for none). A job naming max_tokens is refused past it (above);
    one naming none generates at most this many."""
    if job.logprobs_k is None:
        return None
    return max(1, limits.max_logprob_entries // (job.n * (job.logprobs_k + 1)))


def parse_job(value: bytes | None, limits: Limits) -> JobRequest:
    data = _decode(value, limits)
    if not isinstance(data, dict):
        raise InvalidMessage(f"message must be a JSON object, got {type(data).__name__}")
    try:
        job = JobRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidMessage(_explain(exc), _param(exc)) from None
    _check_limits(job, limits)
    return job


def parse_control(value: bytes | None, limits: Limits) -> CancelRequest:
    data = _decode(value, limits)
    try:
        return CancelRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidMessage(_explain(exc)) from None


def _peek(value: bytes | None, field: str) -> str | None:
    """A top-level string field of a message that failed validation, best effort: parsed when the JSON is
    readable, else found by pattern (a giant number or deep nesting elsewhere must not hide the id)."""
    try:
        data = json.loads(value or b"")
        found = data.get(field) if isinstance(data, dict) else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        match = re.search(rb'"%s"\s*:\s*"([^"\\\x00]{1,128})"' % field.encode(), (value or b"")[:100_000])
        found = match.group(1).decode("utf-8", "replace") if match else None
    if isinstance(found, str) and 0 < len(found) <= 128 and _unstorable(found) is None:
        return found
    return None


def peek_job_id(value: bytes | None) -> str | None:
    """Best-effort job_id of a message that failed validation, so its rejection can be recorded."""
    return _peek(value, "job_id")


def peek_tenant(value: bytes | None) -> str:
    """Best-effort tenant of a message that failed validation (its rejection belongs to that tenant)."""
    return _peek(value, "tenant") or "default"
