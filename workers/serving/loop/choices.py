"""A job's n samples as they arrive from the engine: text, finish reason, tokens and log probabilities of
each, in OpenAI's shapes. Used by the Kafka worker (InFlightJob) and `inferq run-batch` alike."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpu.engine_types import TokenLogprob
from schemas.tool_calls import Parsed, ToolCallParser, ToolDialect, call_id

# Finish reasons that end the whole request, whatever its other samples were doing.
REQUEST_ENDS = frozenset({"abort", "expired", "rejected", "error"})
# JSON has no -Infinity (PostgreSQL's jsonb and the results' parsers refuse it): a token the sampler
# could never pick gets OpenAI's and vLLM's floor instead.
LOGPROB_FLOOR = -9999.0


class LogprobFormatter:
    """Engine logprobs → OpenAI's chat entries `{"token", "logprob", "bytes", "top_logprobs"}`.

    A token's text is what the tokenizer decodes it to alone (U+FFFD for a piece of a multi-byte
    character); its bytes are the token's own (`token_bytes`: both built-in tokenizers have it, so a
    choice's bytes add up to its text's UTF-8), else that text's UTF-8.
    Lookups are cached: the same few thousand tokens recur in every top list. Not thread-safe: one per
    thread, with that thread's tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._token_bytes = getattr(tokenizer, "token_bytes", None)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def token(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            text = self._tokenizer.decode([token_id]).replace("\x00", "\ufffd")  # storable in jsonb
            raw = self._token_bytes(token_id) if self._token_bytes is not None else text.encode()
            found = self._cache[token_id] = (text, bytes(raw))
        return found

    def entry(self, lp: TokenLogprob) -> dict[str, Any]:
        return self.kept((lp.token_id, lp.logprob, lp.top))

    def kept(self, item: Kept) -> dict[str, Any]:
        token_id, logprob, alternatives = item
        text, raw = self.token(token_id)
        top = []
        for top_id, top_logprob in alternatives:
            top_text, top_raw = self.token(top_id)
            top.append({"token": top_text, "logprob": _finite(top_logprob), "bytes": list(top_raw)})
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw), "top_logprobs": top}

    def entries(self, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        return [self.entry(lp) for lp in logprobs]


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


# One token's logprobs as kept until the job ends: (token id, logprob, ((id, logprob), ...)). Tuples of
# numbers, which the garbage collector stops tracking, where dicts (7 per token with top 5) would be walked
# by every collection on the engine thread for as long as the job runs; OpenAI's dicts are built once, at
# the end (and for each token event as it is sent).
Kept = tuple[int, float, tuple[tuple[int, float], ...]]


@dataclass
class Sample:
    index: int
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[Kept] | None = None  # one per token, when asked
    last_token_mono: float | None = None
    tools: ToolCallParser | None = None  # takes its tool calls out of its text (a job with tools)


class Choices:
    """The samples of one job; the job is over when every sample has ended, or one ended the request.
    `logprobs`: the formatter of the job's log probabilities, None when it asked for none. `tools`: the
    dialect the job's tool calls are written in and the seed of their ids (its tenant and job id), for a
    job with tools: each sample's text is then parsed (`parse`), its text is what is not a call, and a
    sample that stops having made calls ends `tool_calls`."""

    def __init__(
        self,
        n: int = 1,
        logprobs: LogprobFormatter | None = None,
        tools: tuple[ToolDialect, str] | None = None,
    ) -> None:
        self.samples = [Sample(i, logprobs=[] if logprobs else None) for i in range(n)]
        self.logprob_format = logprobs
        if tools is not None:
            dialect, seed = tools
            for s in self.samples:
                s.tools = ToolCallParser(dialect, lambda position, i=s.index: call_id(seed, i, position))

    @property
    def parses_tools(self) -> bool:
        return self.samples[0].tools is not None

    def parse(self, index: int, text: str) -> Parsed:
        """A new piece of sample `index`'s text (a job with tools): its content and pieces of calls; what
        may be the start of a call is held back until it is known."""
        parser = self.samples[index].tools
        assert parser is not None
        return parser.feed(text)

    def parse_end(self, index: int) -> Parsed:
        """What sample `index` held back, decided at its end (before `end`)."""
        parser = self.samples[index].tools
        assert parser is not None
        return parser.finish()

    @property
    def with_logprobs(self) -> bool:
        return self.logprob_format is not None

    def add(self, index: int, tokens: int, text: str, logprobs: Sequence[TokenLogprob] = ()) -> Sample:
        sample = self.samples[index]
        sample.text.append(text)
        sample.tokens += tokens
        if sample.logprobs is not None and logprobs:
            sample.logprobs.extend((lp.token_id, lp.logprob, lp.top) for lp in logprobs)
        return sample

    def end(self, index: int, reason: str) -> str | None:
        """Record how sample `index` ended; the job's finish reason once the job is over, else None.

        That is the first reason that ends the request (abort, expired, ...), else sample 0's. A sample
        that stopped having made tool calls ends `tool_calls`, as OpenAI's do.
        """
        sample = self.samples[index]
        if reason == "stop" and sample.tools is not None and sample.tools.calls:
            reason = "tool_calls"
        sample.finish_reason = reason
        if reason in REQUEST_ENDS:
            return reason
        if all(s.finish_reason is not None for s in self.samples):
            return self.samples[0].finish_reason
        return None

    @property
    def completion_tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    @property
    def longest(self) -> int:
        """The most tokens one sample has: the number of decode steps behind the job so far."""
        return max(s.tokens for s in self.samples)

    def text(self, index: int = 0) -> str:
        return "".join(self.samples[index].text)

    @property
    def worth_storing(self) -> bool:
        """Whether the row needs its `choices` column: one sample without logprobs or tools is its
        output_text."""
        return len(self.samples) > 1 or self.with_logprobs or self.parses_tools

    def as_json(self, job_finish: str) -> list[dict[str, Any]]:
        """`choices` of the row and the result; a sample cut short by the job's end carries its reason."""
        fmt = self.logprob_format
        return [
            {
                "index": s.index,
                "text": "".join(s.text),
                "finish_reason": s.finish_reason or job_finish,
                "logprobs": (
                    {"content": [fmt.kept(k) for k in s.logprobs]}
                    if fmt is not None and s.logprobs is not None
                    else None
                ),
                **({"tool_calls": s.tools.calls or None} if s.tools is not None else {}),
            }
            for s in self.samples
        ]
