"""Token sampling for a whole step at once: greedy, temperature, top-k, top-p, forced tokens.

The logits of a row go through, in this order: logit_bias, repetition_penalty, presence and frequency
penalties (gpu/logits_processors.py; only for rows that use them), then temperature, top-k and top-p
before the draw. Log probabilities are the log_softmax of the logits after bias and penalties and
before temperature, top-k and top-p: the model's distribution as the request's bias and penalties
shaped it, the same whatever the temperature, and equal to HF's log_softmax of the model's logits when
no bias or penalty is set. A grammar's mask (gpu/runner.py) comes first of all, so under a grammar the
forbidden tokens have no probability.

Greedy rows (the common case) take one argmax. Rows that sample are filtered and drawn together, with no
per-row Python loop: each draw is an inverse-CDF lookup of one uniform number per row, a pure function of
(seed, sample, position) (gpu/samples.py), so a request's draws are the same whatever shares its batch, in
whatever order, and after a resume. Every row's result depends on that row alone: a filter another row uses
leaves a row that does not use it exactly as it was (top-k's threshold is -inf there, top-p's 2).

No host syncs: everything sampling needs is decided on the host while the step is prepared
(`SamplingBatch.for_step`, numpy: which rows draw, which filters apply, the largest k, the uniforms, the
forced tokens) and reaches the device in one copy that does not block (`SamplingBatch.to`, gpu/transfer.py).
`sample` reads no device value: on CUDA it only queues work, and the step's tokens are the first thing the
host waits for. The live sequences' settings are kept as numpy columns (gpu/sampling_table.py), so a step
of hundreds of rows gathers them with a few array lookups, not a Python pass per setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from gpu.logits_processors import LogitsPlan, apply, count_sampled
from gpu.samples import uniforms
from gpu.sampling_table import SamplingTable
from gpu.transfer import tensors_to
from scheduler.types import SamplingParams

_ARGMAX_BLOCK = 128
_NO_TOP_P = 2.0  # the top-p threshold of a row that keeps everything: no mass before a token reaches it
_MIN_TOP_P = 1e-9  # top_p 0 keeps the most likely token (the first is never dropped)


def fast_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of [S, V], the same index as torch.argmax (first maximum on ties) but faster on CPU.

    The maximum per block of the vocabulary, then argmax inside the first block that holds the row maximum.
    """
    rows, vocab = logits.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)  # the blocked trick only pays off on CPU
    pad = -vocab % _ARGMAX_BLOCK
    if pad:
        logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    blocks = logits.view(rows, -1, _ARGMAX_BLOCK)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)  # first block holding the maximum
    inner = blocks[torch.arange(rows, device=logits.device), best_block].argmax(dim=-1)
    return best_block * _ARGMAX_BLOCK + inner


@dataclass(frozen=True)
class SamplingBatch:
    """A step's sampling settings for its S sampling rows, built on the host; R of them draw at random.

    Host values decide which operations run (`draws_all`, `max_top_k`, `top_k_partial`, whether `top_p`
    and `forced_rows` are set): nothing about them is read from the device."""

    rows: torch.Tensor | None  # [R] int64 the rows that draw; None: none does (forced tokens only)
    draws_all: bool  # R == S: the draws are the tokens (no argmax, no scatter)
    temperature: torch.Tensor | None  # [R] float32
    uniforms: torch.Tensor | None  # [R] float64 in [0, 1)
    max_top_k: int  # the largest k any drawing row keeps; 0: none uses top-k
    # [R] int64 index of each row's k-th largest among the max_top_k largest; max_top_k (an appended -inf
    # column) where a row keeps them all
    top_k: torch.Tensor | None
    top_k_partial: bool  # some drawing row keeps them all
    top_p: torch.Tensor | None  # [R] float32 (2.0: keeps all); None: no drawing row uses top-p
    forced_rows: torch.Tensor | None  # [F] rows whose token is given (a resumed sample's last saved token)
    forced_tokens: torch.Tensor | None  # [F] int64

    @classmethod
    def for_step(
        cls,
        table: SamplingTable,
        chunks: Sequence[Any],
        vocab_size: int,
        forced: Any = None,
        rows: np.ndarray | None = None,
    ) -> SamplingBatch | None:
        """Settings of a step's sampling chunks (scheduler.output.ScheduledChunk), from the table (`rows`:
        theirs, when known). `forced`: a gpu.resume.ResumeRows whose forced rows take their given tokens.
        None: every row is greedy (one argmax, no settings)."""
        forcing = forced is not None and len(forced.forced_rows)
        if not table.drawing and not forcing:  # every live sequence is greedy: no lookup at all
            return None
        rows = table.rows(chunks) if rows is None else rows
        draws = table.derived(rows, "draws", lambda: _Draws.of(table, rows, vocab_size))
        if draws is None and not forcing:
            return None
        if draws is None:
            return cls._of(None, len(chunks), _NO_POSITIONS, forced)
        if draws.count == len(chunks):  # every row draws (a sampled batch): no indexing
            positions = np.fromiter(map(_NUM_GENERATED, chunks), np.int64, len(chunks))
        else:
            positions = np.fromiter(map(_NUM_GENERATED, map(chunks.__getitem__, draws.indices)), np.int64)
        return cls._of(draws, len(chunks), positions, forced)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        keys: Sequence[int],
        positions: Sequence[int],
        vocab_size: int,
        forced: Any = None,
    ) -> SamplingBatch | None:
        """`for_step` from lists: each row's params, stream key (gpu.samples.stream_key), output position."""
        table = SamplingTable(max(len(params), 1))
        chunks = []
        for i, (p, key, position) in enumerate(zip(params, keys, positions, strict=True)):
            table.add(str(i), key, p)
            chunks.append(_Row(str(i), position))
        return cls.for_step(table, chunks, vocab_size, forced)

    @classmethod
    def _of(cls, draws: _Draws | None, num_rows: int, positions: np.ndarray, forced: Any) -> SamplingBatch:
        """The step's settings: the drawing rows' (and their uniforms at these output positions) and the
        forced rows'."""
        forced_rows = forced_tokens = None
        if forced is not None and len(forced.forced_rows):
            forced_rows = torch.from_numpy(forced.forced_rows)
            forced_tokens = torch.from_numpy(forced.forced_tokens)
        if draws is None:
            return cls(None, False, None, None, 0, None, False, None, forced_rows, forced_tokens)
        return cls(
            rows=draws.rows,
            draws_all=draws.count == num_rows,
            temperature=draws.temperature,
            uniforms=torch.from_numpy(uniforms(draws.keys, positions)),
            max_top_k=draws.max_top_k,
            top_k=draws.top_k,
            top_k_partial=draws.top_k_partial,
            top_p=draws.top_p,
            forced_rows=forced_rows,
            forced_tokens=forced_tokens,
        )

    def to(self, device: torch.device) -> SamplingBatch:
        """The settings on `device`: one copy from pinned memory that does not block (CPU: these)."""
        return tensors_to(self, device)


@dataclass(frozen=True)
class _Draws:
    """What a step's drawing rows' settings decide, from the settings alone: which rows draw, their
    temperature, which filters run and with which thresholds (host tensors, shared read-only by the steps of
    the same rows: SamplingTable.derived)."""

    indices: list[int]  # the drawing rows, among the step's sampling rows
    count: int
    rows: torch.Tensor  # [R] int64 the same
    keys: np.ndarray  # [R] int64 their stream keys (gpu/samples.py)
    temperature: torch.Tensor  # [R] float32
    max_top_k: int
    top_k: torch.Tensor | None
    top_k_partial: bool
    top_p: torch.Tensor | None

    @classmethod
    def of(cls, table: SamplingTable, rows: np.ndarray, vocab_size: int) -> _Draws | None:
        """None: no row draws."""
        temperature = table.temperature[rows]
        random = np.flatnonzero(temperature > 0.0)
        if not len(random):
            return None
        picked = rows[random]
        top_k, top_p = table.top_k[picked], table.top_p[picked]
        max_top_k, partial, k_index, p_threshold = 0, False, None, None
        kept = (top_k > 0) & (top_k < vocab_size)
        if kept.any():
            max_top_k = int(top_k[kept].max())
            partial = not kept.all()
            k_index = torch.from_numpy(np.where(kept, top_k - 1, max_top_k))
        nucleus = top_p < 1.0
        if nucleus.any():
            threshold = np.where(nucleus, np.maximum(top_p, _MIN_TOP_P), _NO_TOP_P).astype(np.float32)
            p_threshold = torch.from_numpy(threshold)
        return cls(
            indices=random.tolist(),
            count=len(random),
            rows=torch.from_numpy(random),
            keys=table.keys[picked],
            temperature=torch.from_numpy(temperature[random]),
            max_top_k=max_top_k,
            top_k=k_index,
            top_k_partial=partial,
            top_p=p_threshold,
        )


_NUM_GENERATED = attrgetter("num_generated")
_NO_POSITIONS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class _Row:
    """What `SamplingTable.rows` and `for_step` read of a chunk (SamplingBatch.build's stand-in)."""

    seq_id: str
    num_generated: int


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, then top-k, then top-p on the drawing rows' logits [R, V]; removed tokens get -inf."""
    assert batch.temperature is not None
    logits = logits.float() / batch.temperature[:, None]
    if batch.max_top_k:
        assert batch.top_k is not None
        top = torch.topk(logits, batch.max_top_k, dim=-1).values
        if batch.top_k_partial:  # rows keeping every token read this column: nothing is below -inf
            top = torch.nn.functional.pad(top, (0, 1), value=float("-inf"))
        logits = logits.masked_fill(logits < top.gather(1, batch.top_k[:, None]), float("-inf"))
    if batch.top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does (never
        # the first: top_p > 0; a row at 2.0 drops none).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= batch.top_p[:, None]
        kept = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(kept).scatter_(1, order, kept)  # back to vocabulary order
    return logits


def draw(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row of filtered logits [R, V] with uniforms [R] in [0, 1) on their device."""
    cdf = torch.cumsum(torch.softmax(logits, dim=-1, dtype=torch.float64), dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    # The first token whose cumulative mass exceeds the target: never a token of zero probability.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch | None,
    plan: LogitsPlan | None = None,
    greedy: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of logits [S, V]; batch None: every row is greedy. batch and plan on the logits'
    device (`.to`). plan: bias and penalties, applied to logits in place (so log probabilities can be read
    from them afterwards). greedy: each row's argmax of these very logits when the device already computed
    it (inside a CUDA graph): never written into (the graph owns it). Reads nothing from the device."""
    if plan is not None:
        apply(logits, plan)
    if batch is None:
        tokens = fast_argmax(logits) if greedy is None else greedy
        if plan is not None:
            count_sampled(tokens, plan)
        return tokens
    if batch.draws_all:
        assert batch.uniforms is not None
        tokens = draw(filter_logits(logits, batch), batch.uniforms)
    else:
        tokens = fast_argmax(logits) if greedy is None else greedy.clone()
        if batch.rows is not None:
            assert batch.uniforms is not None
            drawn = draw(filter_logits(logits.index_select(0, batch.rows), batch), batch.uniforms)
            tokens.index_copy_(0, batch.rows, drawn)
    if batch.forced_rows is not None:
        assert batch.forced_tokens is not None
        tokens.index_copy_(0, batch.forced_rows, batch.forced_tokens)
    if plan is not None:
        count_sampled(tokens, plan)
    return tokens
