"""Which OpenAI Batch body fields inferq reads, and which it accepts without reading them.

A file written for OpenAI or `vllm run-batch` often carries fields at values that change nothing
(`n: 1`, `logprobs: false`, `presence_penalty: 0`, `user`, `stream_options`, ...). Those are accepted;
the same fields at a value that would change the output are refused with a reason, for that line only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# Fields that shape generation; to_job reads them.
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
GENERATION = {COMPLETIONS: _SAMPLING | {"prompt"}, CHAT: _SAMPLING | {"messages", "max_completion_tokens"}}


def _absent_or(*values: Any) -> Callable[[Any], bool]:
    """None, or equal to one of `values` with the same type (so `true` is not taken for `1`)."""
    return lambda v: v is None or any(type(v) is type(x) and v == x for x in values)


def _number(value: float) -> Callable[[Any], bool]:
    return lambda v: v is None or (type(v) in (int, float) and v == value)


def _of_type(*types: type) -> Callable[[Any], bool]:
    return lambda v: v is None or isinstance(v, types)


# field -> (accepted?, what is accepted, for the error message)
_Rule = tuple[Callable[[Any], bool], str]
_COMMON: dict[str, _Rule] = {
    "n": (_absent_or(1), "1"),
    "stream": (_absent_or(False), "false (a batch is not streamed)"),
    "stream_options": (_of_type(dict), "an object (ignored without streaming)"),
    "user": (_of_type(str), "a string (ignored)"),
    "logprobs": (_absent_or(False), "false or null (log probabilities are not returned)"),
    "presence_penalty": (_number(0), "0 (penalties are not applied)"),
    "frequency_penalty": (_number(0), "0 (penalties are not applied)"),
    "repetition_penalty": (_number(1), "1 (penalties are not applied)"),
    "logit_bias": (lambda v: v is None or v == {}, "empty or null"),
    "service_tier": (_of_type(str), "a string (ignored)"),
}
NEUTRAL: dict[str, dict[str, _Rule]] = {
    COMPLETIONS: {
        **_COMMON,
        "best_of": (_absent_or(1), "1"),
        "echo": (_absent_or(False), "false"),
        "suffix": (_absent_or(""), "empty or null"),
    },
    CHAT: {
        **_COMMON,
        "top_logprobs": (_absent_or(0), "0 or null"),
        "response_format": (lambda v: v is None or v == {"type": "text"}, '{"type": "text"} or null'),
        "store": (_of_type(bool), "a boolean (ignored)"),
        "metadata": (_of_type(dict), "an object (ignored)"),
    },
}


def check_body(url: str, body: dict[str, Any]) -> str | None:
    """Why this body cannot run as asked (None when it can)."""
    unknown = set(body) - GENERATION[url] - set(NEUTRAL[url])
    if unknown:
        return f"unsupported body fields for {url}: {', '.join(sorted(unknown))}"
    for name, (accepted, what) in NEUTRAL[url].items():
        if name in body and not accepted(body[name]):
            return f"body.{name} must be {what}, got {body[name]!r}"
    return None
