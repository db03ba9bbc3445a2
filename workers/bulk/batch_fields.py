"""Every body field of a chat or completion request, and what inferq does with it: the one registry that
Batch lines and the HTTP API both check bodies against (docs/api.md's table lists it, and a test keeps the
two and the official SDK's request types in step).

- `honoured`: the field shapes generation; to_job reads it (sampling, `n`, penalties, `logit_bias`,
  `logprobs`, `response_format`, tools, vLLM's `guided_regex` / `guided_choice`, ...), validated as the
  Kafka job message is (batch_format.to_job).
- `ignored`: accepted and not read, where OpenAI's own answer would not differ for it (`user`, `store`,
  `metadata` on chat, cache hints, `prediction`, which only speeds OpenAI up, ...).
- `partly`: accepted at the values that change nothing (`best_of: 1`, `echo: false`, `modalities:
  ["text"]`, a Batch line's `stream: false`), refused at any other.
- `refused`: inferq cannot do what it asks (audio, web search, reasoning effort, the deprecated
  `functions`); any value but null is refused, naming the field.

A refused value is refused with the field's name (the HTTP API's error `param`), for that line only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

Kind = Literal["honoured", "ignored", "partly", "refused"]


def _absent_or(*values: Any) -> Callable[[Any], bool]:
    """None, or equal to one of `values` with the same type (so `true` is not taken for `1`)."""
    return lambda v: v is None or any(type(v) is type(x) and v == x for x in values)


def _of_type(*types: type) -> Callable[[Any], bool]:
    return lambda v: v is None or isinstance(v, types)


def _anything(_: Any) -> bool:
    return True


@dataclass(frozen=True)
class FieldRule:
    kind: Kind
    accepts: Callable[[Any], bool] = _anything  # the values taken (refused: only null)
    what: str = ""  # what is taken (partly, ignored) or why it is not (refused): the error says it

    def problem(self, name: str, value: Any) -> str | None:
        if self.kind == "refused":
            return None if value is None else f"body.{name} is not supported: {self.what}"
        if not self.accepts(value):
            return f"body.{name} must be {self.what}, got {value!r}"
        return None


HONOURED = FieldRule("honoured")  # checked where it is read (to_job and the job message's validation)

# Fields that shape generation, with the same name and meaning in a body as in the job message.
OPTIONS = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "response_format",
    "guided_regex",
    "guided_choice",
)
CHAT_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls")  # chat only
# inferq's and vLLM's fields beyond OpenAI's (sent as the SDK's `extra_body`)
EXTENSIONS = frozenset({"top_k", "repetition_penalty", "guided_regex", "guided_choice"})

_SAMPLING = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs")
_COMMON: dict[str, FieldRule] = {
    **{name: HONOURED for name in (*_SAMPLING, *OPTIONS)},
    # a Batch line is never streamed (the HTTP API takes both as its own: workers/api/protocol.py)
    "stream": FieldRule("partly", _absent_or(False), "false (a batch is not streamed)"),
    "stream_options": FieldRule("ignored", _of_type(dict), "an object (without streaming, nothing to set)"),
    "user": FieldRule("ignored", _of_type(str), "a string (an end user's id: not used)"),
    "service_tier": FieldRule("ignored", _of_type(str), "a string (the queue class is `priority`)"),
}
_NOT_ON_CHAT = "inferq's chat models answer in text only"
FIELDS: dict[str, dict[str, FieldRule]] = {
    COMPLETIONS: {
        **_COMMON,
        "prompt": HONOURED,
        "best_of": FieldRule("partly", _absent_or(1), "1 (one sample per choice)"),
        "echo": FieldRule("partly", _absent_or(False), "false (the prompt is not echoed)"),
        "suffix": FieldRule("partly", _absent_or(""), "empty or null (no insertion)"),
    },
    CHAT: {
        **_COMMON,
        **{name: HONOURED for name in (*CHAT_OPTIONS, "messages", "max_completion_tokens", "top_logprobs")},
        "store": FieldRule("ignored", _of_type(bool), "a boolean (every job is stored in its row anyway)"),
        "metadata": FieldRule("ignored", _of_type(dict), "an object (OpenAI keeps it with `store`)"),
        "safety_identifier": FieldRule("ignored", _of_type(str), "a string (an end user's id: not used)"),
        "prompt_cache_key": FieldRule("ignored", _of_type(str), "a string (prefix caching is automatic)"),
        "prompt_cache_retention": FieldRule(
            "ignored", _of_type(str), "a string (prefix caching is automatic)"
        ),
        "prompt_cache_options": FieldRule(
            "ignored", _of_type(dict), "an object (prefix caching is automatic)"
        ),
        "prediction": FieldRule(
            "ignored", _of_type(dict), "an object (a speed hint; the answer is the same)"
        ),
        "modalities": FieldRule("partly", _absent_or(["text"]), f'["text"] ({_NOT_ON_CHAT})'),
        "audio": FieldRule("refused", what=_NOT_ON_CHAT),
        "web_search_options": FieldRule("refused", what="inferq has no web search"),
        "moderation": FieldRule("refused", what="inferq runs no moderation"),
        "reasoning_effort": FieldRule("refused", what="inferq's models take no reasoning effort"),
        "verbosity": FieldRule("refused", what="inferq's models take no verbosity setting"),
        "functions": FieldRule("refused", what="deprecated by OpenAI: use tools"),
        "function_call": FieldRule("refused", what="deprecated by OpenAI: use tool_choice"),
    },
}


def check_body(url: str, body: dict[str, Any]) -> tuple[str, str] | None:
    """(the field, why) when this body cannot run as asked; None when it can. Honoured fields' values are
    checked where they are read (batch_format.to_job)."""
    rules = FIELDS[url]
    unknown = sorted(set(body) - set(rules))
    if unknown:
        return unknown[0], f"unsupported body fields for {url}: {', '.join(unknown)}"
    for name, value in body.items():
        why = rules[name].problem(name, value)
        if why is not None:
            return name, why
    return None
