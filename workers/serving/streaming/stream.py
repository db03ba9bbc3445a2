"""Token events: per-job text deltas, coalesced so Kafka is not sent one message per token under load."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpu.engine_types import TokenLogprob
from schemas.jobs import TokenEvent, Usage

Emit = Callable[[TokenEvent, str], Any]  # sends one event of a tenant's job; returns a handle (or None)


# An event carries at most this many tokens (a longer delta, such as a resumed attempt's restatement of the
# output so far, goes as several): with 20 top logprobs a token is about 1.5 kB of JSON, and a message past
# the topic's size limit (1 MB by default) would be lost.
MAX_EVENT_TOKENS = 256


@dataclass
class _Delta:
    """The unsent output of one of a job's samples (kept and emptied, not rebuilt, between events)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the job asked for them
    offset: int = 0  # tokens of the sample sent before these (its next event's `offset`)
    text_offset: int = 0  # characters of the sample's text sent before these
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's deltas (a job with tools)


@dataclass
class _Pending:
    attempt: int
    tenant: str  # carried in every event's headers (and, with per-tenant topics, naming its topic)
    job_id: str
    seq: int = 0
    deltas: dict[int, _Delta] = field(default_factory=dict)  # by sample index
    tokens: int = 0  # token ids not sent yet
    since: float | None = None  # monotonic time of the oldest unsent delta; None: nothing unsent
    ended: set[int] = field(default_factory=set)  # samples whose last event is sent
    restarted: bool = False  # this attempt starts the output over (every event says so)


class TokenStreamer:
    """Buffers deltas per job and emits a TokenEvent when the oldest one is `coalesce_s` old.

    The first event of a job goes out at the next flush, so coalescing never delays the first token.
    Deltas of one job concatenate exactly to its final output, since nothing is ever dropped; with n > 1
    samples, each event carries one sample's delta (`index`), and a sample's deltas concatenate to its text.
    Each sample's last event carries that sample's own `finish_reason` (sent at once when the sample ends,
    with whatever it had buffered); the attempt's last event, also sent at once, carries `usage` for the
    whole job: with n = 1 that is the one event with a finish reason, as before.
    Log probabilities are turned into OpenAI's entries (`format_logprobs`) only when an event is sent.
    """

    def __init__(
        self,
        emit: Emit,
        coalesce_s: float,
        format_logprobs: Callable[[list[TokenLogprob]], list[dict[str, Any]]] | None = None,
    ) -> None:
        self._emit = emit
        self._coalesce_s = coalesce_s
        self._format_logprobs = format_logprobs
        self._jobs: dict[str, _Pending] = {}  # by the engine's request id of a job (JobKey.request_id)

    def start(
        self,
        request_id: str,
        attempt: int,
        tenant: str = "default",
        job_id: str | None = None,
        restarted: bool = False,
    ) -> None:
        """Start a job's stream under `request_id` (what the other calls name it by); `job_id` (default:
        `request_id`) is what its events carry; `restarted`: an attempt that did not resume (after an
        earlier one) starts the output over, and its events say so."""
        self._jobs[request_id] = _Pending(
            attempt=attempt, tenant=tenant, job_id=job_id or request_id, restarted=restarted
        )

    def restate(
        self,
        request_id: str,
        index: int,
        text: str,
        token_ids: tuple[int, ...],
        logprobs: Sequence[TokenLogprob] | None = None,
        tool_calls: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        """A resumed sample's output so far, sent now from offset 0, apart from what it generates next (a
        consumer that restarts its text on a new attempt gets the whole output again; one that keeps
        each position's first text drops it). `tool_calls`: its calls so far, each from its first delta."""
        p = self._jobs.get(request_id)
        if p is None:
            return
        self.add(request_id, text, token_ids, index, logprobs, tool_calls)
        self._send_sample(p, index, p.deltas[index], None, None)

    def add(
        self,
        request_id: str,
        text: str,
        token_ids: tuple[int, ...],
        index: int = 0,
        logprobs: Sequence[TokenLogprob] | None = None,
        tool_calls: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        """`logprobs`: None when the job asked for none (its events carry none), else one per token id.
        `tool_calls`: pieces of the sample's calls (`text` is then what is not a call)."""
        p = self._jobs[request_id]
        if p.since is None:
            # the first delta of a job is due at once: coalescing must not add to time to first token
            p.since = time.monotonic() if p.seq else float("-inf")
        delta = p.deltas.get(index)
        if delta is None:
            delta = p.deltas[index] = _Delta()
        delta.text.append(text)
        delta.token_ids.extend(token_ids)
        p.tokens += len(token_ids)
        if logprobs is not None:
            if delta.logprobs is None:
                delta.logprobs = []
            delta.logprobs.extend(logprobs)
        if tool_calls:
            _merge_calls(delta.tool_calls, tool_calls)

    def end_sample(self, request_id: str, index: int, finish_reason: str) -> None:
        """Sample `index` ended and the job goes on (its other samples run): its last event, now."""
        p = self._jobs.get(request_id)
        if p is not None and index not in p.ended:
            p.ended.add(index)
            self._send_sample(p, index, p.deltas.get(index) or _Delta(), finish_reason, None)

    def finish(
        self, request_id: str, finish_reason: str, usage: Usage, reasons: dict[int, str | None] | None = None
    ) -> Any:
        """Send the attempt's last events: every sample not ended yet gets its last one, with its reason in
        `reasons` (by index; default and None: `finish_reason`, the job's, e.g. a cancel that cut it short),
        and the very last carries `usage`. Returns what `emit` returned for that one."""
        p = self._jobs.pop(request_id, None)
        if p is None:
            return None
        reasons = reasons or {0: None}
        open_ = [i for i in sorted(set(reasons) | set(p.deltas)) if i not in p.ended] or [max(p.ended)]
        sent = None
        for k, index in enumerate(open_):
            usage_here = usage if k == len(open_) - 1 else None
            delta = p.deltas.get(index) or _Delta()
            sent = self._send_sample(p, index, delta, reasons.get(index) or finish_reason, usage_here)
        return sent

    def drop(self, request_id: str) -> None:
        """Forget a job without a final event (aborted locally; another worker redoes it)."""
        self._jobs.pop(request_id, None)

    def flush_due(self, force: bool = False) -> None:
        now = time.monotonic()
        for p in self._jobs.values():
            if p.tokens and (force or now - p.since >= self._coalesce_s):
                self._send(p, None, None)

    def _send(self, p: _Pending, finish_reason: str | None, usage: Usage | None) -> Any:
        """One event per sample with unsent output, in index order."""
        sent = None
        for index, delta in sorted(p.deltas.items()):
            if delta.text or delta.token_ids or delta.tool_calls:
                sent = self._send_sample(p, index, delta, finish_reason, usage)
        p.tokens = 0
        p.since = None
        return sent

    def _send_sample(
        self, p: _Pending, index: int, delta: _Delta, finish_reason: str | None, usage: Usage | None
    ) -> Any:
        text, ids, logprobs = "".join(delta.text), delta.token_ids, delta.logprobs
        starts = list(range(0, len(ids), MAX_EVENT_TOKENS)) or [0]  # one, unless the delta is too long
        sent = None
        for k, start in enumerate(starts):
            last = k == len(starts) - 1
            end = len(ids) if last else starts[k + 1]
            # the text goes along in proportion (its positions, not its split, are what a consumer keeps)
            text_from = len(text) * start // len(ids) if ids else 0
            text_to = len(text) if last else len(text) * end // len(ids)
            part_logprobs = None if logprobs is None else logprobs[start:end]
            reason, used = (finish_reason, usage) if last else (None, None)
            calls = list(delta.tool_calls) if last and delta.tool_calls else None  # whole, on its last part
            sent = self._send_event(
                p, index, delta, text[text_from:text_to], ids[start:end], part_logprobs, calls, reason, used
            )
        p.tokens -= len(ids)
        delta.text.clear()
        delta.token_ids.clear()
        delta.logprobs = None
        delta.tool_calls.clear()
        if not p.tokens:
            p.since = None
        return sent

    def _send_event(
        self,
        p: _Pending,
        index: int,
        delta: _Delta,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None,
        tool_calls: list[dict[str, Any]] | None,
        finish_reason: str | None,
        usage: Usage | None,
    ) -> Any:
        entries = None
        if logprobs is not None and self._format_logprobs is not None:
            entries = self._format_logprobs(logprobs)
        event = TokenEvent(
            job_id=p.job_id,
            attempt=p.attempt,
            seq=p.seq,
            text=text,
            token_ids=list(token_ids),
            finish_reason=finish_reason,
            usage=usage,
            index=index,
            logprobs=entries,
            tool_calls=tool_calls,
            offset=delta.offset,
            text_offset=delta.text_offset,
            restarted=p.restarted,
        )
        sent = self._emit(event, p.tenant)
        p.seq += 1
        delta.offset += len(token_ids)
        delta.text_offset += len(text)
        return sent


def _merge_calls(pending: list[dict[str, Any]], new: Sequence[dict[str, Any]]) -> None:
    """Add call deltas to those not sent yet: arguments of the call the last one belongs to are appended
    to it (one delta a call per event, as OpenAI's chunks have them)."""
    for delta in new:
        last = pending[-1] if pending else None
        if last is not None and last["index"] == delta["index"] and "id" not in delta:
            last["function"] = {
                **last["function"],
                "arguments": last["function"]["arguments"] + delta["function"]["arguments"],
            }
        else:
            pending.append(delta)
