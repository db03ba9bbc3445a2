"""logit_bias, penalties and log probabilities for the rows of a step whose requests ask for them.

`LogitsState` knows the live sequences that use any of them (most use none) and keeps, for those with a
penalty, what the penalties need: the distinct token ids seen in prompt and output and how often each
was generated, brought up to date with one token per step in O(1) (no history is re-read). It belongs to the
request, not to its KV blocks, so a preempted sequence recomputed from its tokens keeps its counts.

Each step `plan` picks the step's rows that are tracked (nothing at all is done when no live sequence is)
and packs them into a `LogitsPlan` of flat tensors, built on the host while the step is prepared and moved
to the device in one copy that does not block (`LogitsPlan.to`), so every row is processed by the same few
tensor ops, each touching only the logits that change:
- logit_bias: one scatter-add of (row, token id, bias) triples;
- penalties: one gather of the (row, seen token) logits, HF's repetition_penalty on them (positive logits
  divided, negative multiplied), OpenAI's logit -= presence * (count > 0) + frequency * count with the
  counts of generated tokens, one scatter back: O(distinct tokens), never O(rows x vocabulary);
- log probabilities: log_softmax of the rows that asked, the sampled token's value and the top k, launched
  with the step (`launch_logprobs`) and read with its tokens (`read_logprobs`): nothing waits before.
The order (bias, repetition, presence/frequency) is vLLM's. The counts need each step's tokens on the host
(`record`), so a step with tracked rows is never scheduled before the last one's tokens are back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu.engine_types import TokenLogprob
from gpu.penalty_counts import CountedRows, DeviceCounts
from gpu.sampling_table import SamplingTable
from gpu.transfer import tensors_to
from scheduler.output import ScheduledChunk
from scheduler.types import SamplingParams

_TOPK_BLOCK = 128


def fast_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise top k of [R, V] (values and indices, largest first), as torch.topk but far faster on CPU:
    the k largest values lie in the k blocks of the vocabulary whose maxima are largest, so one max per
    block and a top k among k blocks' values suffice (equal values may come in another order)."""
    rows, vocab = x.shape
    if x.device.type != "cpu" or k == 0 or 4 * k * _TOPK_BLOCK > vocab:
        return torch.topk(x, k, dim=-1)
    pad = -vocab % _TOPK_BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    blocks = x.reshape(rows, -1, _TOPK_BLOCK)
    best = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [R, k] blocks holding the k largest values
    candidates = blocks.gather(1, best[:, :, None].expand(-1, -1, _TOPK_BLOCK)).reshape(rows, -1)
    top = candidates.topk(k, dim=-1)
    block = best.gather(1, top.indices // _TOPK_BLOCK)
    return top.values, block * _TOPK_BLOCK + top.indices % _TOPK_BLOCK


def uses_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def uses_processing(p: SamplingParams) -> bool:
    return bool(p.logit_bias) or p.logprobs is not None or uses_penalties(p)


class _Tracked:
    """One tracked sequence: its settings, its bias as arrays, and its token counts when penalised."""

    __slots__ = (
        "sampling",
        "bias_ids",
        "bias_values",
        "biased",
        "penalised",
        "slots",
        "seen",
        "generated",
        "size",
    )

    def __init__(
        self, prompt: Sequence[int], sampling: SamplingParams, vocab_size: int, counts_here: bool = True
    ) -> None:
        self.sampling = sampling
        # Ids outside the vocabulary cannot be logits: dropped here rather than failing every step.
        pairs = [(t, b) for t, b in sampling.logit_bias if 0 <= t < vocab_size]
        self.bias_ids = np.array([t for t, _ in pairs], dtype=np.int64)
        self.bias_values = np.array([b for _, b in pairs], dtype=np.float32)
        self.biased = bool(pairs)
        self.penalised = uses_penalties(sampling)
        # The distinct ids of prompt and output in seen[:size], in order of first sight, with how often each
        # was generated; slots maps an id to its index there. Penalised sequences counted here only.
        distinct = list(dict.fromkeys(prompt)) if self.penalised and counts_here else []
        self.slots = {token: i for i, token in enumerate(distinct)}
        self.size = len(distinct)
        self.seen = np.empty(self.size + 16, dtype=np.int64)
        self.seen[: self.size] = distinct
        self.generated = np.zeros(self.size + 16, dtype=np.float32)

    def append(self, token: int) -> None:
        """Count a generated token."""
        i = self.slots.get(token)
        if i is None:
            i = self.slots[token] = self.size
            self.size += 1
            if i == len(self.seen):  # full: double (amortised O(1) per token)
                self.seen = np.concatenate([self.seen, np.empty_like(self.seen)])
                self.generated = np.concatenate([self.generated, np.zeros_like(self.generated)])
            self.seen[i] = token
        self.generated[i] += 1.0


@dataclass(frozen=True)
class LogitsPlan:
    """What to do to the logits rows [S, V] of one step's sampling rows (built as CPU tensors; `to`)."""

    # logit_bias, as triples: logits[bias_rows[i], bias_ids[i]] += bias_values[i]
    bias_rows: torch.Tensor  # [B] int64
    bias_ids: torch.Tensor  # [B] int64
    bias_values: torch.Tensor  # [B] float32
    # penalties, per (row, token seen in its prompt or output) pair: N pairs, no row holds an id twice
    seen_rows: torch.Tensor  # [N] int64
    seen_ids: torch.Tensor  # [N] int64
    seen_generated: torch.Tensor  # [N] float32 times the token was generated
    presence: torch.Tensor  # [N] float32, the pair's row's setting
    frequency: torch.Tensor  # [N] float32
    repetition: torch.Tensor  # [N] float32, 1 = off
    any_repetition: bool
    # log probabilities of the Q rows that asked
    logprob_rows: torch.Tensor  # [Q] int64
    logprob_k: tuple[int, ...]  # top alternatives per row (0..20)
    logprob_seq_ids: tuple[str, ...]
    # the penalised sequences, to count the token sampled in their row
    penalised_rows: tuple[int, ...]
    penalised: tuple[_Tracked, ...]
    # the device path's penalised rows instead of the pairs above (gpu/penalty_counts.py), and their counts
    counted: CountedRows | None = None
    counts: DeviceCounts | None = None

    # its copies on other devices (`to`): a plan is used by every step of the same rows (LogitsState.plan)
    _on: dict[torch.device, LogitsPlan] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def to(self, device: torch.device) -> LogitsPlan:
        """The plan on `device`: its tensors in one non-blocking copy from pinned memory, once (CPU: this)."""
        if device.type == "cpu":
            return self
        moved = self._on.get(device)
        if moved is None:
            moved = tensors_to(self, device)
            if self.counted is not None:
                moved = dataclasses.replace(moved, counted=self.counted.to(device))
            self._on[device] = moved
        return moved


class LogitsState:
    """The live sequences that use logit_bias, a penalty or log probabilities (the engine adds and drops
    them with their requests; the runner plans each step from it and records what it sampled).
    `device_counts`: penalty counts live on the device (gpu/penalty_counts.py: the CUDA path), not here.
    `table`: the engine's sampling table, where every live sequence has its row (its settings are read from
    there for a whole step at once); None: one of its own (the state used alone)."""

    def __init__(
        self, vocab_size: int, device_counts: bool = False, table: SamplingTable | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self.counts = DeviceCounts(vocab_size) if device_counts else None
        self.table = SamplingTable() if table is None else table
        self._own_table = table is None
        self._tracked: dict[str, _Tracked] = {}
        self._logprobs: dict[str, TokenLogprob] = {}  # the last step's, until taken

    def __bool__(self) -> bool:
        return bool(self._tracked)

    def add(
        self, seq_id: str, prompt: Sequence[int], sampling: SamplingParams, generated: Sequence[int] = ()
    ) -> None:
        """Track a sequence that uses any of them; `generated`: the output tokens it starts with (resumed).
        (Its row in the engine's table is there already.)"""
        if self._own_table:
            self.table.add(seq_id, 0, sampling)
        if uses_processing(sampling):
            counts = self.counts
            tracked = self._tracked[seq_id] = _Tracked(prompt, sampling, self.vocab_size, counts is None)
            if tracked.penalised and counts is not None:
                counts.add(self.table.row(seq_id), prompt, generated)
            elif tracked.penalised:
                for token in generated:
                    tracked.append(token)

    def drop(self, seq_id: str) -> None:
        """(Before its row leaves the engine's table.)"""
        tracked = self._tracked.pop(seq_id, None)
        if tracked is not None and tracked.penalised and self.counts is not None:
            self.counts.drop(self.table.row(seq_id))
        if self._own_table:
            self.table.drop(seq_id)

    def plan(self, chunks: Sequence[ScheduledChunk], rows: np.ndarray | None = None) -> LogitsPlan | None:
        """The plan for the step's sampling chunks (the logits' rows, in order; `rows`: their table rows,
        when known); None: no row is tracked."""
        if self.counts is not None:  # penalties counted on the device: found and planned with arrays
            table = self.table
            rows = table.rows(chunks) if rows is None else rows
            # the plan of a step with the last one's rows and slots: that one's (a decode step's, mostly)
            kept = table.derived(rows, "logits plan", dict)
            if kept and kept["slots"] == self.counts.version:
                return kept["plan"]
            plan = self._plan(chunks, rows)
            if plan is None or plan.counted is None or not len(plan.counted.fresh):  # (fresh: built once)
                kept.update(slots=self.counts.version, plan=plan)
            return plan
        return self._plan(chunks, rows)

    def _plan(self, chunks: Sequence[ScheduledChunk], rows: np.ndarray | None) -> LogitsPlan | None:
        tracked = self._tracked
        counted = None
        if self.counts is not None:
            table = self.table
            assert rows is not None
            on_device = np.flatnonzero(table.penalised[rows])
            if len(on_device):
                counted = self.counts.rows(on_device, rows[on_device], table)
            picked = [(i, tracked[chunks[i].seq_id]) for i in np.flatnonzero(table.host[rows]).tolist()]
            if not picked and counted is None:
                return None
        else:
            picked = [(i, t) for i, c in enumerate(chunks) if (t := tracked.get(c.seq_id)) is not None]
            if not picked:
                return None
        biased, penalised, asked = [], [], []
        for i, t in picked:  # one pass: a step may hold hundreds of tracked rows
            if t.biased:
                biased.append((i, t))
            if t.penalised and self.counts is None:
                penalised.append((i, t))
            if t.sampling.logprobs is not None:
                asked.append((i, chunks[i].seq_id, t.sampling.logprobs))
        pairs = _pairs(penalised)
        return LogitsPlan(
            **_bias(biased),
            **pairs,
            logprob_rows=torch.tensor([i for i, _, _ in asked], dtype=torch.int64) if asked else _NO_ROWS,
            logprob_k=tuple(k for _, _, k in asked),
            logprob_seq_ids=tuple(s for _, s, _ in asked),
            penalised_rows=tuple(i for i, _ in penalised),
            penalised=tuple(t for _, t in penalised),
            counted=counted,
            counts=self.counts if counted is not None else None,
        )

    def record(self, plan: LogitsPlan, tokens: Sequence[int], logprobs: dict[str, TokenLogprob]) -> None:
        """The step sampled `tokens` (one per row) and computed `logprobs`: count the penalised tokens."""
        self._logprobs = logprobs
        for row, tracked in zip(plan.penalised_rows, plan.penalised, strict=True):
            tracked.append(tokens[row])

    def take_logprobs(self) -> dict[str, TokenLogprob]:
        """The log probabilities the last step computed, by sequence (then forgotten)."""
        logprobs, self._logprobs = self._logprobs, {}
        return logprobs


def _concat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype)


_NO_ROWS = torch.zeros(0, dtype=torch.int64)
_NO_VALUES = torch.zeros(0, dtype=torch.float32)


def _bias(biased: list[tuple[int, _Tracked]]) -> dict[str, torch.Tensor]:
    """LogitsPlan's bias triples of the biased rows."""
    if not biased:
        return dict(bias_rows=_NO_ROWS, bias_ids=_NO_ROWS, bias_values=_NO_VALUES)
    rows = np.repeat(np.array([i for i, _ in biased], dtype=np.int64), [len(t.bias_ids) for _, t in biased])
    return dict(
        bias_rows=torch.from_numpy(rows),
        bias_ids=torch.from_numpy(np.concatenate([t.bias_ids for _, t in biased])),
        bias_values=torch.from_numpy(np.concatenate([t.bias_values for _, t in biased])),
    )


def _pairs(penalised: list[tuple[int, _Tracked]]) -> dict[str, Any]:
    """LogitsPlan's (row, seen token) pairs of the rows whose counts are kept here."""
    if not penalised:
        empty = dict(seen_rows=_NO_ROWS, seen_ids=_NO_ROWS, seen_generated=_NO_VALUES)
        return empty | dict(
            presence=_NO_VALUES, frequency=_NO_VALUES, repetition=_NO_VALUES, any_repetition=False
        )
    seen_counts = [t.size for _, t in penalised]
    params = [t.sampling for _, t in penalised]

    def per_pair(values: list[float]) -> torch.Tensor:
        return torch.from_numpy(np.repeat(np.array(values, dtype=np.float32), seen_counts))

    return dict(
        seen_rows=torch.from_numpy(
            np.repeat(np.array([i for i, _ in penalised], dtype=np.int64), seen_counts)
        ),
        seen_ids=torch.from_numpy(np.concatenate([t.seen[: t.size] for _, t in penalised])),
        seen_generated=torch.from_numpy(np.concatenate([t.generated[: t.size] for _, t in penalised])),
        presence=per_pair([p.presence_penalty for p in params]),
        frequency=per_pair([p.frequency_penalty for p in params]),
        repetition=per_pair([p.repetition_penalty for p in params]),
        any_repetition=any(p.repetition_penalty != 1.0 for p in params),
    )


def apply(logits: torch.Tensor, plan: LogitsPlan) -> None:
    """logit_bias, then repetition, presence and frequency penalties, in place on logits [S, V] (the plan on
    their device). Reads nothing from the device: which steps run is the plan's shape, known on the host."""
    vocab = logits.shape[-1]
    flat = logits.view(-1)  # (row, id) pairs as flat indices: 1-D take/put are the fast kernels on CPU
    if len(plan.bias_rows):
        index = plan.bias_rows * vocab + plan.bias_ids
        # an id listed twice adds both (the job layer sorts and dedupes anyway)
        flat.index_add_(0, index, plan.bias_values.to(logits.dtype))
    if plan.counted is not None and plan.counts is not None:
        plan.counts.apply(logits, plan.counted)
    if not len(plan.seen_rows):
        return
    index = plan.seen_rows * vocab + plan.seen_ids  # no pair twice
    values = flat.take(index).float()
    if plan.any_repetition:
        penalty = plan.repetition
        values = torch.where(values > 0, values / penalty, values * penalty)
    generated = plan.seen_generated
    values -= plan.frequency * generated + plan.presence * (generated > 0)
    flat.index_copy_(0, index, values.to(logits.dtype))


def count_sampled(tokens: torch.Tensor, plan: LogitsPlan) -> None:
    """The device path's counts take the step's sampled tokens [S] (on the device: nothing is read)."""
    if plan.counted is not None and plan.counts is not None:
        plan.counts.count(tokens, plan.counted)


def history_plan(
    prompt: Sequence[int],
    generated: Sequence[int],
    first: int,
    count: int,
    sampling: SamplingParams,
    vocab_size: int,
) -> LogitsPlan | None:
    """A plan for `count` rows of one sequence at successive positions, row r as the step that sampled
    generated[first + r] had it: the bias, and penalties counted over generated[:first + r] (a resumed
    sample's saved tokens, their logprobs recomputed). None: neither applies."""
    if not sampling.logit_bias and not uses_penalties(sampling):
        return None
    tracked = _Tracked(prompt, sampling, vocab_size)
    rows, ids, counts = [], [], []
    if tracked.penalised:
        for token in generated[:first]:
            tracked.append(token)
        for r in range(count):
            rows.append(np.full(tracked.size, r, dtype=np.int64))
            ids.append(tracked.seen[: tracked.size].copy())
            counts.append(tracked.generated[: tracked.size].copy())
            tracked.append(generated[first + r])
    pairs = sum(len(r) for r in rows)

    def per_pair(value: float) -> torch.Tensor:
        return torch.full((pairs,), value, dtype=torch.float32)

    biased = len(tracked.bias_ids)
    return LogitsPlan(
        bias_rows=torch.arange(count, dtype=torch.int64).repeat_interleave(biased),
        bias_ids=torch.from_numpy(np.tile(tracked.bias_ids, count)),
        bias_values=torch.from_numpy(np.tile(tracked.bias_values, count)),
        seen_rows=torch.from_numpy(_concat(rows, np.int64)),
        seen_ids=torch.from_numpy(_concat(ids, np.int64)),
        seen_generated=torch.from_numpy(_concat(counts, np.float32)),
        presence=per_pair(sampling.presence_penalty),
        frequency=per_pair(sampling.frequency_penalty),
        repetition=per_pair(sampling.repetition_penalty),
        any_repetition=sampling.repetition_penalty != 1.0,
        logprob_rows=torch.zeros(0, dtype=torch.int64),
        logprob_k=(),
        logprob_seq_ids=(),
        penalised_rows=(),
        penalised=(),
    )


def row_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [R, V]: the given token's log probability then the k largest, as (values, ids)
    [R, 1 + k] on the logits' device (read them with one transfer each)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = tokens[:, None]
    top_values, top_ids = fast_topk(logprobs, k)  # most likely first
    return torch.cat([logprobs.gather(1, picked), top_values], dim=1), torch.cat([picked, top_ids], dim=1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, plan: LogitsPlan) -> dict[str, TokenLogprob]:
    """The sampled token's log probability and the k most likely, per row that asked, from logits [S, V]
    as `apply` left them (before temperature, top-k and top-p): launched, then read at once."""
    return read_logprobs(plan, launch_logprobs(logits, tokens, plan))


def launch_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, plan: LogitsPlan
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`token_logprobs`' device part (the plan on the logits' device): (values, ids) [Q, 1 + k] for
    `read_logprobs`; None when no row asked."""
    if not plan.logprob_k:
        return None
    every = len(plan.logprob_k) == len(logits)  # every row asked: no copy
    x = logits if every else logits.index_select(0, plan.logprob_rows)
    picked = tokens if every else tokens.index_select(0, plan.logprob_rows)
    return row_logprobs(x, picked, max(plan.logprob_k))


def read_logprobs(
    plan: LogitsPlan, launched: tuple[torch.Tensor, torch.Tensor] | None
) -> dict[str, TokenLogprob]:
    """The log probabilities `launch_logprobs` computed, by sequence (reads the device: after the tokens)."""
    if launched is None:
        return {}
    values, ids = launched[0].tolist(), launched[1].tolist()  # one transfer for the values, one for the ids
    out = {}
    for seq_id, row_ids, row_values, n in zip(plan.logprob_seq_ids, ids, values, plan.logprob_k, strict=True):
        top_n = tuple(zip(row_ids[1 : n + 1], row_values[1 : n + 1], strict=True))
        out[seq_id] = TokenLogprob(row_ids[0], row_values[0], top_n)
    return out
