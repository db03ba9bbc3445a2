"""Which OpenAI Batch body fields inferq reads, and which it accepts without reading them.

Fields that shape generation (sampling, `n`, penalties, `logit_bias`, `logprobs`, `response_format`, and
vLLM's `guided_regex` / `guided_choice`) become the job's fields and are validated as the Kafka job
message is (batch_format.to_job). A file written for OpenAI or `vllm run-batch` also often carries fields
at values that change nothing (`stream: false`, `best_of: 1`, `user`, `stream_options`, ...). Those are
accepted; the same fields at a value that would change the output are refused with a reason, for that
line only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# Fields that shape generation; to_job reads them. The completions API's `logprobs` is a count (of top
# log probabilities), the chat API's a boolean with `top_logprobs` beside it.
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs"}
OPTIONS = (  # the same name and meaning in a body as in the job message
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "response_format",
    "guided_regex",
    "guided_choice",
)
GENERATION = {
    COMPLETIONS: _SAMPLING | set(OPTIONS) | {"prompt"},
    CHAT: _SAMPLING | set(OPTIONS) | {"messages", "max_completion_tokens", "top_logprobs"},
}


def _absent_or(*values: Any) -> Callable[[Any], bool]:
    """None, or equal to one of `values` with the same type (so `true` is not taken for `1`)."""
    return lambda v: v is None or any(type(v) is type(x) and v == x for x in values)


def _of_type(*types: type) -> Callable[[Any], bool]:
    return lambda v: v is None or isinstance(v, types)


# field -> (accepted?, what is accepted, for the error message)
_Rule = tuple[Callable[[Any], bool], str]
_COMMON: dict[str, _Rule] = {
    "stream": (_absent_or(False), "false (a batch is not streamed)"),
    "stream_options": (_of_type(dict), "an object (ignored without streaming)"),
    "user": (_of_type(str), "a string (ignored)"),
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
