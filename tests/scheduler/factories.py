"""Builders and a fake model for scheduler tests (no torch: the "model" is a deterministic function)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduler.config import SchedulerConfig
from scheduler.output import ScheduledChunk, SchedulerOutput
from scheduler.scheduler import Scheduler
from scheduler.types import FinishReason, Priority, SamplingParams, SequenceRequest

EOS = 2


def make_config(**overrides: object) -> SchedulerConfig:
    """Small defaults so a handful of requests exercises every budget; aging off unless asked for."""
    values: dict[str, object] = dict(
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=256,
        enable_prefix_caching=True,
        aging_s=math.inf,
    )
    values.update(overrides)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def make_scheduler(**overrides: object) -> Scheduler:
    return Scheduler(make_config(**overrides))


def make_request(
    seq_id: str = "r0",
    prompt_len: int = 8,
    max_tokens: int = 4,
    *,
    prompt: Iterable[int] | None = None,
    priority: Priority = Priority.NORMAL,
    tenant: str = "default",
    arrival: float = 0.0,
    deadline: float | None = None,
    eos_token_ids: frozenset[int] = frozenset({EOS}),
    ignore_eos: bool = True,
    stop_token_ids: tuple[int, ...] = (),
    lora: str | None = None,
) -> SequenceRequest:
    """A request whose prompt is unique to its id (no accidental prefix hits) unless `prompt` is given."""
    if prompt is None:
        prompt = [1000 + zlib.crc32(f"{seq_id}:{i}".encode()) % 50_000 for i in range(prompt_len)]
    return SequenceRequest(
        seq_id=seq_id,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids),
        priority=priority,
        tenant=tenant,
        arrival=arrival,
        deadline=deadline,
        eos_token_ids=eos_token_ids,
        lora=lora,
    )


def make_requests(n: int, prefix: str = "r", **kwargs: object) -> list[SequenceRequest]:
    """n requests r0..r{n-1} arriving at t = 0, 1, 2, ... (override `arrival` to make them simultaneous)."""
    arrival = kwargs.pop("arrival", None)
    return [
        make_request(f"{prefix}{i}", arrival=float(i) if arrival is None else arrival, **kwargs)  # type: ignore[arg-type]
        for i in range(n)
    ]


def fake_token_for(seq_id: str, num_generated: int) -> int:
    """The "model": a deterministic next token from the sequence id and how much it generated so far."""
    return 10 + (sum(map(ord, seq_id)) * 31 + num_generated * 7) % 500


def fake_token(chunk: ScheduledChunk) -> int:
    return fake_token_for(chunk.seq_id, chunk.num_generated)


def sample_all(output: SchedulerOutput) -> dict[str, int]:
    return {c.seq_id: fake_token(c) for c in output.chunks if c.sample}


@dataclass
class RunLog:
    """What a driven run produced: each sequence's ending and output, and per-step records."""

    endings: dict[str, list[FinishReason]] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)

    def end(self, seq_id: str, reason: FinishReason) -> None:
        self.endings.setdefault(seq_id, []).append(reason)


def step(scheduler: Scheduler, now: float, log: RunLog) -> SchedulerOutput:
    """One schedule → fake forward → update round, recorded in log."""
    output = scheduler.schedule(now)
    log.steps.append(output)
    for finished in output.finished:
        log.end(finished.seq_id, finished.reason)
    for update in scheduler.update(output, sample_all(output)):
        log.outputs.setdefault(update.seq_id, []).append(update.token_id)
        if update.finish is not None:
            log.end(update.seq_id, update.finish)
    return output


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000, start: float = 0.0) -> RunLog:
    log = RunLog()
    now = start
    while scheduler.has_unfinished():
        assert len(log.steps) < max_steps, "scheduler made no progress"
        step(scheduler, now, log)
        now += 1.0
    return log
