"""Latency math of `bench e2e`, from the client's view: submit times and token-event arrival times.

Pure functions over plain data, so the definitions are unit-tested apart from Kafka and the clock:

- TTFT = arrival of the job's first token event - its submit time.
- ITL = per job, (last event arrival - first event arrival) / (tokens - tokens of the first event):
  the worker coalesces deltas, so one event carries several tokens; the tokens that came after the first
  event are the ones whose generation that span covers. A job whose tokens all came in one event has none.
- e2e = arrival of the job's final event (usage set) - its submit time.
Percentiles interpolate linearly between order statistics (numpy's default), over jobs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrival:
    """One token event as the client saw it."""

    at_s: float  # perf_counter() when the client received it
    tokens: int  # token ids it carries
    final: bool = False
    completion_tokens: int | None = None  # usage, on the final event


@dataclass(frozen=True)
class JobTrace:
    job_id: str
    submitted_s: float
    arrivals: tuple[Arrival, ...]  # in arrival order

    @property
    def finished(self) -> bool:
        return any(a.final for a in self.arrivals)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks; None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    data = sorted(v for v in values if v is not None and math.isfinite(v))
    if not data:
        return None
    rank = (len(data) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


def ttft_ms(trace: JobTrace) -> float | None:
    first = next((a for a in trace.arrivals if a.tokens > 0), None)
    return None if first is None else (first.at_s - trace.submitted_s) * 1000


def itl_ms(trace: JobTrace) -> float | None:
    with_tokens = [a for a in trace.arrivals if a.tokens > 0]
    if len(with_tokens) < 2:
        return None
    later_tokens = sum(a.tokens for a in with_tokens[1:])
    return (with_tokens[-1].at_s - with_tokens[0].at_s) * 1000 / later_tokens


def e2e_ms(trace: JobTrace) -> float | None:
    final = next((a for a in trace.arrivals if a.final), None)
    return None if final is None else (final.at_s - trace.submitted_s) * 1000


def completion_tokens(trace: JobTrace) -> int:
    """Tokens of the job: the final event's usage when present, else the tokens streamed."""
    final = next((a for a in trace.arrivals if a.final), None)
    if final is not None and final.completion_tokens is not None:
        return final.completion_tokens
    return sum(a.tokens for a in trace.arrivals)


def per_job(traces: Iterable[JobTrace]) -> dict[str, list[float]]:
    """Every job's TTFT and ITL in ms (jobs without one left out): the distributions the figure shows."""
    traces = list(traces)
    return {
        "ttft_ms": [v for v in map(ttft_ms, traces) if v is not None],
        "itl_ms": [v for v in map(itl_ms, traces) if v is not None],
    }


def latency_summary(traces: Iterable[JobTrace]) -> dict[str, float | int | None]:
    """p50/p99 of TTFT, ITL and e2e in ms over the jobs, with how many jobs each covers."""
    traces = list(traces)
    out: dict[str, float | int | None] = {"jobs": len(traces), "finished": sum(t.finished for t in traces)}
    for name, metric in (("ttft", ttft_ms), ("itl", itl_ms), ("e2e", e2e_ms)):
        values = [v for v in map(metric, traces) if v is not None]
        out[f"{name}_p50_ms"] = percentile(values, 50)
        out[f"{name}_p99_ms"] = percentile(values, 99)
        out[f"{name}_n"] = len(values)
    return out


def throughput(traces: Sequence[JobTrace]) -> tuple[int, float | None]:
    """(completion tokens, wall seconds from the first submit to the last final event) of a batch of jobs."""
    tokens = sum(completion_tokens(t) for t in traces)
    finals = [e2e for t in traces if (e2e := _final_at(t)) is not None]
    if not traces or len(finals) < len(traces):
        return tokens, None
    return tokens, max(finals) - min(t.submitted_s for t in traces)


def _final_at(trace: JobTrace) -> float | None:
    return next((a.at_s for a in trace.arrivals if a.final), None)
