"""logit_bias, penalties and log probabilities for the rows of a step whose requests ask for them.

`LogitsState` knows the live sequences that use any of them (most use none) and keeps, for those with a
penalty, the token ids the penalties count: the prompt, then one token appended per step. It belongs to
the request, not to its KV blocks, so a preempted sequence recomputed from its tokens keeps its counts.

Each step `plan` picks the step's rows that are tracked (nothing at all is done when no live sequence is)
and packs them into a `LogitsPlan` of tensors, so every row is processed by the same few tensor ops:
- logit_bias: one scatter-add of (row, token id, bias) triples;
- penalties: the rows' histories padded to [H, L] (padding is an extra vocabulary column that is cut
  off), scatter-added into [H, V] counts of generated tokens and a [H, V] "seen in prompt or output" mask;
  HF's repetition_penalty (positive logits divided, negative multiplied, for seen tokens), then OpenAI's
  logit -= presence * (count > 0) + frequency * count over generated tokens;
- log probabilities: log_softmax of the rows that asked, the sampled token's value and the top k.
The order (bias, repetition, presence/frequency) is vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu.engine_types import TokenLogprob
from scheduler.output import ScheduledChunk
from scheduler.types import SamplingParams


def uses_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def uses_processing(p: SamplingParams) -> bool:
    return bool(p.logit_bias) or p.logprobs is not None or uses_penalties(p)


class _Tracked:
    """One tracked sequence: its settings, its bias as arrays, and its token history when penalised."""

    __slots__ = ("sampling", "bias_ids", "bias_values", "tokens", "num_prompt", "length")

    def __init__(self, prompt: Sequence[int], sampling: SamplingParams, vocab_size: int) -> None:
        self.sampling = sampling
        # Ids outside the vocabulary cannot be logits: dropped here rather than failing every step.
        pairs = [(t, b) for t, b in sampling.logit_bias if 0 <= t < vocab_size]
        self.bias_ids = np.array([t for t, _ in pairs], dtype=np.int64)
        self.bias_values = np.array([b for _, b in pairs], dtype=np.float32)
        self.num_prompt = self.length = len(prompt)
        self.tokens: np.ndarray | None = None
        if uses_penalties(sampling):
            # Room for every token the request may generate: appending never reallocates.
            self.tokens = np.empty(len(prompt) + max(sampling.max_tokens, 1), dtype=np.int64)
            self.tokens[: len(prompt)] = prompt

    def append(self, token: int) -> None:
        tokens = self.tokens
        if tokens is None:
            return
        if self.length == len(tokens):  # more tokens than max_tokens promised (a caller's choice): grow
            tokens = self.tokens = np.concatenate([tokens, np.empty_like(tokens)])
        tokens[self.length] = token
        self.length += 1


@dataclass(frozen=True)
class LogitsPlan:
    """What to do to the logits rows [S, V] of one step's sampling rows (CPU tensors, moved on use)."""

    # logit_bias, as triples: logits[bias_rows[i], bias_ids[i]] += bias_values[i]
    bias_rows: torch.Tensor  # [B] int64
    bias_ids: torch.Tensor  # [B] int64
    bias_values: torch.Tensor  # [B] float32
    # penalties of the H penalised rows
    penalty_rows: torch.Tensor  # [H] int64
    history: torch.Tensor  # [H, L] int64 prompt + generated ids; padding = V (a column cut off after)
    generated: torch.Tensor  # [H, L] float32, 1 where history holds a generated token
    presence: torch.Tensor  # [H] float32
    frequency: torch.Tensor  # [H] float32
    repetition: torch.Tensor  # [H] float32, 1 = off
    any_repetition: bool
    # log probabilities of the Q rows that asked
    logprob_rows: tuple[int, ...]
    logprob_k: tuple[int, ...]  # top alternatives per row (0..20)
    logprob_seq_ids: tuple[str, ...]
    # histories to extend with the sampled token, with their rows
    history_rows: tuple[int, ...]
    histories: tuple[_Tracked, ...]


class LogitsState:
    """The live sequences that use logit_bias, a penalty or log probabilities (the engine adds and drops
    them with their requests; the runner plans each step from it and records what it sampled)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tracked: dict[str, _Tracked] = {}
        self._logprobs: dict[str, TokenLogprob] = {}  # the last step's, until taken

    def __bool__(self) -> bool:
        return bool(self._tracked)

    def add(self, seq_id: str, prompt: Sequence[int], sampling: SamplingParams) -> None:
        if uses_processing(sampling):
            self._tracked[seq_id] = _Tracked(prompt, sampling, self.vocab_size)

    def drop(self, seq_id: str) -> None:
        self._tracked.pop(seq_id, None)

    def plan(self, chunks: Sequence[ScheduledChunk]) -> LogitsPlan | None:
        """The plan for the step's sampling chunks (the logits' rows, in order); None: no row is tracked."""
        tracked = self._tracked
        rows = [(i, tracked[c.seq_id]) for i, c in enumerate(chunks) if c.seq_id in tracked]
        if not rows:
            return None
        biased = [(i, t) for i, t in rows if len(t.bias_ids)]
        penalised = [(i, t) for i, t in rows if t.tokens is not None]
        asked = [
            (i, chunks[i].seq_id, t.sampling.logprobs) for i, t in rows if t.sampling.logprobs is not None
        ]
        history, generated = _pack_histories([t for _, t in penalised], self.vocab_size)
        params = [t.sampling for _, t in penalised]
        return LogitsPlan(
            bias_rows=torch.from_numpy(
                np.repeat(
                    np.array([i for i, _ in biased], dtype=np.int64), [len(t.bias_ids) for _, t in biased]
                )
            ),
            bias_ids=torch.from_numpy(_concat([t.bias_ids for _, t in biased], np.int64)),
            bias_values=torch.from_numpy(_concat([t.bias_values for _, t in biased], np.float32)),
            penalty_rows=torch.tensor([i for i, _ in penalised], dtype=torch.long),
            history=torch.from_numpy(history),
            generated=torch.from_numpy(generated),
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
            any_repetition=any(p.repetition_penalty != 1.0 for p in params),
            logprob_rows=tuple(i for i, _, _ in asked),
            logprob_k=tuple(k for _, _, k in asked),
            logprob_seq_ids=tuple(s for _, s, _ in asked),
            history_rows=tuple(i for i, _ in penalised),
            histories=tuple(t for _, t in penalised),
        )

    def record(self, plan: LogitsPlan, tokens: Sequence[int], logprobs: dict[str, TokenLogprob]) -> None:
        """The step sampled `tokens` (one per row) and computed `logprobs`: extend the histories."""
        self._logprobs = logprobs
        for row, tracked in zip(plan.history_rows, plan.histories, strict=True):
            tracked.append(tokens[row])

    def take_logprobs(self) -> dict[str, TokenLogprob]:
        """The log probabilities the last step computed, by sequence (then forgotten)."""
        logprobs, self._logprobs = self._logprobs, {}
        return logprobs


def _concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype)


def _pack_histories(histories: list[_Tracked], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[H, L] ids padded with vocab_size, and [H, L] 1.0 where a generated token is."""
    width = max((t.length for t in histories), default=0)
    ids = np.full((len(histories), width), vocab_size, dtype=np.int64)
    for row, t in enumerate(histories):  # one copy per penalised row, not per token
        ids[row, : t.length] = t.tokens[: t.length]
    positions = np.arange(width)
    start = np.array([t.num_prompt for t in histories], dtype=np.int64)[:, None]
    end = np.array([t.length for t in histories], dtype=np.int64)[:, None]
    return ids, ((positions >= start) & (positions < end)).astype(np.float32)


def apply(logits: torch.Tensor, plan: LogitsPlan) -> None:
    """logit_bias, then repetition, presence and frequency penalties, in place on logits [S, V]."""
    device = logits.device
    if plan.bias_rows.numel():
        logits.index_put_(
            (plan.bias_rows.to(device), plan.bias_ids.to(device)),
            plan.bias_values.to(device, logits.dtype),
            accumulate=True,  # an id listed twice adds both (the job layer sorts and dedupes anyway)
        )
    if not plan.penalty_rows.numel():
        return
    rows = plan.penalty_rows.to(device)
    vocab = logits.shape[-1]
    history = plan.history.to(device)
    sub = logits[rows].float()
    counts = torch.zeros(sub.shape[0], vocab + 1, device=device)
    counts.scatter_add_(1, history, plan.generated.to(device))
    counts = counts[:, :vocab]
    if plan.any_repetition:
        seen = torch.zeros(sub.shape[0], vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, history, True)
        penalty = plan.repetition.to(device)[:, None]
        sub = torch.where(seen[:, :vocab], torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    sub -= plan.frequency.to(device)[:, None] * counts + plan.presence.to(device)[:, None] * (counts > 0)
    logits[rows] = sub.to(logits.dtype)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, plan: LogitsPlan) -> dict[str, TokenLogprob]:
    """The sampled token's log probability and the k most likely, per row that asked, from logits [S, V]
    as `apply` left them (before temperature, top-k and top-p)."""
    if not plan.logprob_rows:
        return {}
    rows = torch.tensor(plan.logprob_rows, dtype=torch.long, device=logits.device)
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = logprobs.gather(1, tokens[rows][:, None]).squeeze(1).tolist()
    k = max(plan.logprob_k)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if k:
        top = torch.topk(logprobs, k, dim=-1)  # sorted: most likely first
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    picked = tokens[rows].tolist()
    return {
        seq_id: TokenLogprob(token, value, tuple(zip(ids[:n], values[:n], strict=True)))
        for seq_id, token, value, ids, values, n in zip(
            plan.logprob_seq_ids, picked, chosen, top_ids, top_values, plan.logprob_k, strict=True
        )
    }
