"""Resuming a request from the tokens an earlier attempt generated (EngineRequest.resume).

A resumed sample is admitted as a prefill of its prompt and its saved tokens but the last; the step that
samples after that prefill takes the last saved token as its sampled token (forced, in the sampler). So the
last saved token goes the ordinary way: EOS, stop tokens, stop strings, max_tokens and a grammar's end apply
to it as they did in the earlier attempt (a sample that was already complete ends on the resuming step), its
logprob is computed as any sampled token's, and the next token is drawn as an uninterrupted run drew it (the
randomness of a position depends only on the seed, the sample and the position: gpu/sampler.py).

Before anything is added, `replay` walks the other saved tokens through the sample's detokenizer and grammar
matcher, as the engine's steps did, and refuses (ResumeRefused) tokens an uninterrupted run could not have
produced: past a stop token, a stop string or the grammar's end, or rejected by the grammar. The penalties'
counts and the JSON closing state are brought up to date the same way by the engine.

When the request asks for logprobs, the prefill's logits at the saved positions are gathered (the runner adds
those rows to the step's logits) and processed as each position's own step processed them: the grammar
mask of the matcher's state there, the JSON closing of its budget's last tokens, logit_bias, and penalties
with the counts as they were there (`SavedLogprobs`). No cache may serve those positions (the scheduler's
`logits_from`), so every one of them runs through the model.

What a worker sees (RequestOutput.resumed): each resumed sample's first output that carries tokens carries all
its saved tokens, their text (exactly the deltas an uninterrupted run emitted for them, joined: text held back
then, such as a partial stop string or an incomplete character, is held back now too) and their logprobs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu.detokenizer import Detokenizer
from gpu.engine_types import EngineRequest, ResumeRefused, TokenLogprob
from gpu.grammar.closing import Closing, closing_window
from gpu.logits_processors import apply, history_plan, row_logprobs
from gpu.transfer import to_device
from scheduler.output import ScheduledChunk


def saved_tokens(request: EngineRequest, vocab_size: int, max_model_len: int) -> tuple[tuple[int, ...], ...]:
    """The request's saved tokens, one entry per sample (empty: it starts afresh), checked for what needs
    no replay; raises ResumeRefused."""
    n = max(request.n, 1)
    resume = tuple(tuple(tokens) for tokens in request.resume)
    if len(resume) > n:
        raise ResumeRefused(f"{len(resume)} samples' tokens to resume a request of n = {n}")
    sampling = request.sampling
    if not sampling.greedy and sampling.seed is None and any(resume):
        raise ResumeRefused("a sampled request resumes only with the seed of the attempt it continues")
    prompt = len(request.prompt_token_ids)
    for index, tokens in enumerate(resume):
        if len(tokens) > sampling.max_tokens:
            raise ResumeRefused(
                f"sample {index}: {len(tokens)} saved tokens, more than max_tokens ({sampling.max_tokens})"
            )
        if prompt + len(tokens) > max_model_len:
            raise ResumeRefused(
                f"sample {index}: prompt ({prompt}) + {len(tokens)} saved tokens exceed the context "
                f"({max_model_len})"
            )
        outside = [t for t in tokens if not 0 <= t < vocab_size]
        if outside:
            raise ResumeRefused(
                f"sample {index}: token id {outside[0]} is outside the vocabulary ({vocab_size})"
            )
    return resume + ((),) * (n - len(resume))


def stop_token_ids(sampling: Any, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """The tokens that end a sequence by themselves (as scheduler.sequence.Sequence has them)."""
    return frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else eos_token_ids)


def check_resume(
    request: EngineRequest,
    tokenizer: Any,
    vocab_size: int,
    max_model_len: int,
    eos_token_ids: frozenset[int],
    matcher: Callable[[Any], Any],
) -> None:
    """Raise ResumeRefused where the engine would (gpu.engine_process checks in the worker's process, so
    that a refusal is raised by add_request there too). `matcher(grammar)`: a fresh matcher of it."""
    stop_ids = stop_token_ids(request.sampling, eos_token_ids)
    for tokens in saved_tokens(request, vocab_size, max_model_len):
        if tokens:
            detokenizer = Detokenizer(tokenizer, request.prompt_token_ids, request.stop)
            grammar = None if request.grammar is None else matcher(request.grammar)
            replay(tokens, detokenizer, grammar, stop_ids)


def replay(
    tokens: Sequence[int],
    detokenizer: Detokenizer,
    matcher: Any,
    stop_token_ids: frozenset[int],
    on_position: Callable[[int, Any], None] | None = None,
    on_token: Callable[[int], None] | None = None,
) -> str:
    """Walk tokens[:-1] through the detokenizer and the grammar matcher (None: unconstrained) as the steps
    that generated them did, and check that the last one may follow: the text those tokens emitted, joined.
    `on_position(j, matcher)` is called before token j is taken (the state its logits were processed in),
    `on_token(token)` after. Raises ResumeRefused where an uninterrupted run would have ended, or the grammar
    refuses a token."""
    pieces = []
    for j, token in enumerate(tokens[:-1]):
        if on_position is not None:
            on_position(j, matcher)
        if token in stop_token_ids:
            raise ResumeRefused(f"saved token {j} ({token}) is a stop token: the output ended there")
        if matcher is not None:
            if not matcher.accept_token(token):
                raise ResumeRefused(f"the grammar rejects saved token {j} ({token})")
            if matcher.is_terminated():
                raise ResumeRefused(f"the grammar ends at saved token {j} ({token})")
        pieces.append(detokenizer.push(token))
        if detokenizer.stopped:
            raise ResumeRefused(f"a stop string ends the output at saved token {j}")
        if on_token is not None:
            on_token(token)
    if tokens and matcher is not None and not matcher.fork().accept_token(tokens[-1]):
        raise ResumeRefused(f"the grammar rejects saved token {len(tokens) - 1} ({tokens[-1]})")
    return "".join(pieces)


@dataclass
class SavedLogprobs:
    """What the logprobs of a resumed sample's saved tokens but the last are recomputed from: for saved token
    j (predicted by the logits at position num_prompt - 1 + j), the grammar mask and JSON closing state its
    step had; bias and penalties come from the prompt, the tokens before j and the settings."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]  # the saved tokens but the last (the targets)
    sampling: Any  # scheduler.types.SamplingParams
    vocab_size: int
    masks: Any = None  # int32 bitmask [len(tokens), words] (gpu.grammar.mask), row j before token j
    # j -> (closing state [inside a string, after a backslash], a fork of the matcher there): the positions in
    # their budget's closing window, for a JSON grammar
    closing: dict[int, tuple[list[bool], Any]] = field(default_factory=dict)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.logprobs = [None] * len(self.tokens)

    @property
    def complete(self) -> bool:
        return all(lp is not None for lp in self.logprobs)

    def observe(self, closing: Closing | None, state: list[bool] | None) -> Callable[[int, Any], None] | None:
        """The `replay` callback recording each position's mask and, for a JSON grammar (`state`: its
        closing state, which replay's `on_token` keeps up to date), the closing of its budget's last tokens
        (None: no grammar, nothing to record)."""
        if self.masks is None:
            return None
        from gpu.grammar.mask import fill_row

        max_tokens = self.sampling.max_tokens

        def record(j: int, matcher: Any) -> None:
            fill_row(self.masks, j, matcher)
            if state is not None and closing is not None and max_tokens - j <= closing_window(max_tokens):
                self.closing[j] = (list(state), matcher.fork())

        return record

    def process(
        self, logits: torch.Tensor, first: int, closing: Closing | None
    ) -> Callable[[list[int]], None]:
        """Logits [G, V] at saved tokens first..first+G-1, processed in place as their steps processed theirs;
        their logprobs computed on the device. Returns what reads them into `logprobs` (after the step's
        tokens are read: nothing here waits for the device)."""
        count = logits.shape[0]
        if self.masks is not None:
            from gpu.grammar.mask import apply_bitmask

            apply_bitmask(logits, self.masks[first : first + count], self.vocab_size)
            due = [(j - first, *self.closing[j]) for j in range(first, first + count) if j in self.closing]
            if due and closing is not None:
                closing.restrict_states(logits, due)
        plan = history_plan(self.prompt, self.tokens, first, count, self.sampling, self.vocab_size)
        if plan is not None:
            apply(logits, plan.to(logits.device))
        targets = np.array(self.tokens[first : first + count], dtype=np.int64)
        k = self.sampling.logprobs or 0
        values, ids = row_logprobs(logits, to_device({"targets": targets}, logits.device)["targets"], k)

        def read(_tokens: list[int]) -> None:
            for j, (row_ids, row_values) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), first):
                top = tuple(zip(row_ids[1 : k + 1], row_values[1 : k + 1], strict=True))
                self.logprobs[j] = TokenLogprob(row_ids[0], row_values[0], top)

        return read


@dataclass
class ResumedSample:
    """A resumed sample until its saved tokens are out (the engine's, keyed by sequence id)."""

    tokens: tuple[int, ...]  # every saved token; the last is forced on the resuming step
    num_prompt: int
    text: str  # what tokens[:-1] emitted
    logprobs: SavedLogprobs | None = None  # None: the request asks for none

    @property
    def forced_at(self) -> int:
        """The sequence's num_generated when its last saved token is sampled (forced)."""
        return len(self.tokens) - 1

    def gather_range(self) -> tuple[int, int]:
        """Positions whose logits give the logprobs of tokens[:-1]: [first, end)."""
        return self.num_prompt - 1, self.num_prompt - 1 + len(self.tokens) - 1


@dataclass(frozen=True)
class ResumeRows:
    """A step's rows for resumed samples: the sampling rows whose token is forced, and the input rows whose
    logits are gathered for saved tokens' logprobs (in the order they are appended to the step's logits)."""

    forced_rows: np.ndarray  # int64 [F] indexes into the step's sampling rows
    forced_tokens: np.ndarray  # int64 [F]
    gathered: np.ndarray  # int64 [G] flat input rows
    spans: tuple[tuple[SavedLogprobs, int, int], ...]  # (whose, first saved token, count), in gathered order


def resume_rows(
    chunks: Sequence[ScheduledChunk],
    sample_chunks: Sequence[ScheduledChunk],
    resumes: Mapping[str, ResumedSample],
) -> ResumeRows | None:
    """The step's forced and gathered rows (None: it has neither)."""
    forced = [
        (i, r.tokens[-1])
        for i, c in enumerate(sample_chunks)
        if (r := resumes.get(c.seq_id)) is not None and c.num_generated == r.forced_at
    ]
    gathered: list[np.ndarray] = []
    spans = []
    row = 0
    for chunk in chunks:
        r = resumes.get(chunk.seq_id)
        if r is not None and r.logprobs is not None:
            first, end = r.gather_range()
            start = max(first, chunk.start_position)
            stop = min(end, chunk.start_position + len(chunk.token_ids))
            if start < stop:
                offset = row - chunk.start_position  # input row of a position of this chunk
                gathered.append(np.arange(offset + start, offset + stop))
                spans.append((r.logprobs, start - first, stop - start))
        row += len(chunk.token_ids)
    if not forced and not gathered:
        return None
    return ResumeRows(
        forced_rows=np.array([i for i, _ in forced], dtype=np.int64),
        forced_tokens=np.array([t for _, t in forced], dtype=np.int64),
        gathered=np.concatenate(gathered) if gathered else np.zeros(0, dtype=np.int64),
        spans=tuple(spans),
    )


def process_gathered(
    logits: torch.Tensor, rows: ResumeRows, closing: Closing | None
) -> list[Callable[[list[int]], None]]:
    """The gathered logits [G, V], span by span: processed, their logprobs launched; the readers."""
    readers = []
    at = 0
    for saved, first, count in rows.spans:
        readers.append(saved.process(logits[at : at + count], first, closing))
        at += count
    return readers
