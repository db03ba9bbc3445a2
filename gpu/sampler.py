"""Token sampling for a whole step at once: greedy, temperature, top-k, top-p; per-request seeds.

The logits of a row go through, in this order: logit_bias, repetition_penalty, presence and frequency
penalties (gpu/logits_processors.py; only for rows that use them), then temperature, top-k and top-p
before the draw. Log probabilities are the log_softmax of the logits after bias and penalties and
before temperature, top-k and top-p: the model's distribution as the request's bias and penalties
shaped it, the same whatever the temperature, and equal to HF's log_softmax of the model's logits when
no bias or penalty is set. A grammar's mask (gpu/runner.py) comes first of all, so under a grammar the
forbidden tokens have no probability.

Greedy rows (the common case) take one argmax. Rows that sample are filtered and drawn together, with no
per-row Python loop: each draw is an inverse-CDF lookup of one uniform number per row, and that number
depends only on the request's seed and how many tokens it generated so far, so a request's draws are
reproducible whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu.logits_processors import LogitsPlan, apply
from scheduler.types import SamplingParams

_ARGMAX_BLOCK = 128
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


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


def step_uniforms(seeds: np.ndarray, num_generated: np.ndarray) -> np.ndarray:
    """One uniform number in [0, 1) per row from (seed, tokens generated): splitmix64, vectorised."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as splitmix64 intends
        z = seeds.astype(np.uint64) * _GOLDEN + num_generated.astype(np.uint64) + np.uint64(1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(12)).astype(np.float64) / float(1 << 52)  # 52 bits: u * total < total


@dataclass(frozen=True)
class SamplingBatch:
    """The sampling settings of a step's sampling rows, as tensors."""

    random_rows: torch.Tensor  # [R] rows that draw at random (temperature > 0)
    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64, 0 = off
    top_p: torch.Tensor  # [R] float32, 1 = off
    uniforms: torch.Tensor  # [R] float64 in [0, 1)
    forced_rows: torch.Tensor | None = None  # [F] rows whose token is given (a resumed sample's last saved)
    forced_tokens: torch.Tensor | None = None  # [F]

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], seeds: Sequence[int], num_generated: Sequence[int]
    ) -> SamplingBatch:
        """Settings of every row that draws at random among all the step's sampling rows."""
        rows = [i for i, p in enumerate(params) if not p.greedy]
        return cls.of_rows(
            rows, [params[i] for i in rows], [seeds[i] for i in rows], [num_generated[i] for i in rows]
        )

    @classmethod
    def of_rows(
        cls,
        rows: Sequence[int],
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        num_generated: Sequence[int],
        forced: Any = None,
    ) -> SamplingBatch:
        """Settings of the given random rows (params, seeds and counts are theirs, in the same order).
        `forced`: a gpu.resume.ResumeRows whose forced rows take their given tokens."""
        has_forced = forced is not None and len(forced.forced_rows)
        return cls(
            random_rows=torch.tensor(rows, dtype=torch.long),
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            uniforms=torch.from_numpy(
                step_uniforms(
                    np.array(seeds, dtype=np.int64).view(np.uint64), np.array(num_generated, dtype=np.int64)
                )
            ),
            forced_rows=torch.from_numpy(forced.forced_rows) if has_forced else None,
            forced_tokens=torch.from_numpy(forced.forced_tokens) if has_forced else None,
        )


def filter_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Temperature, then top-k, then top-p on rows [R, V]; removed tokens get -inf."""
    logits = logits.float() / temperature[:, None]
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    if bool((k < vocab).any()):
        kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    nucleus = top_p < 1.0
    if bool(nucleus.any()):
        rows = nucleus.nonzero().flatten()
        sorted_logits, order = torch.sort(logits[rows], descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p[rows, None]
        drop[:, 0] = False
        kept = sorted_logits.masked_fill(drop, float("-inf"))
        logits[rows] = torch.empty_like(kept).scatter_(1, order, kept)  # back to vocabulary order
    return logits


def draw(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row of filtered logits [R, V] with uniforms [R] in [0, 1)."""
    cdf = torch.cumsum(torch.softmax(logits, dim=-1, dtype=torch.float64), dim=-1)
    target = (uniforms.to(cdf.device) * cdf[:, -1])[:, None]
    # The first token whose cumulative mass exceeds the target: never a token of zero probability.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch | None,
    plan: LogitsPlan | None = None,
    greedy: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of logits [S, V]; batch None: every row is greedy. plan: bias and penalties,
    applied to logits in place (so log probabilities can be read from them afterwards). greedy: each
    row's argmax of these very logits when the device already computed it (inside a CUDA graph)."""
    if plan is not None:
        apply(logits, plan)
    if greedy is not None and batch is not None:
        greedy = greedy.clone()  # a graph's output buffer: the draws below write into a copy
    tokens = fast_argmax(logits) if greedy is None else greedy
    if batch is not None and batch.random_rows.numel():
        rows = batch.random_rows.to(logits.device)
        filtered = filter_logits(
            logits[rows], *(t.to(logits.device) for t in (batch.temperature, batch.top_k, batch.top_p))
        )
        tokens[rows] = draw(filtered, batch.uniforms)
    if batch is not None and batch.forced_rows is not None:  # (a graph's greedy buffer was copied above)
        tokens[batch.forced_rows.to(tokens.device)] = batch.forced_tokens.to(tokens.device)
    return tokens
