"""A job this worker is running: where it came from, its timings, its output so far (every sample's)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from gpu.engine_types import EngineRequest, TokenLogprob
from schemas.job_key import JobKey
from schemas.jobs import JobRequest, Timings, Usage
from schemas.statuses import STATUS_OF_FINISH
from schemas.tool_calls import ToolDialect
from workers.clock import utcnow
from workers.db.jobs import Terminal
from workers.kafka_io import Coordinates
from workers.serving.loop.choices import Choices, LogprobFormatter
from workers.serving.loop.progress import JobProgress


@dataclass
class InFlightJob:
    job_id: str
    attempt: int
    priority: str
    request: JobRequest
    created_at: datetime  # the Kafka timestamp: when the producer posted it
    sources: list[Coordinates]  # every message carrying this job
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, found in the prefix cache (the engine's, on sample 0's end)
    queued_mono: float = field(default_factory=time.monotonic)
    queued_at: datetime = field(default_factory=utcnow)
    started_at: datetime | None = None
    first_token_at: datetime | None = None
    first_token_mono: float | None = None
    last_token_mono: float | None = None
    logprob_format: LogprobFormatter | None = None  # turns the job's logprobs into OpenAI's, if it asked
    tool_dialect: ToolDialect | None = None  # how its output writes tool calls (None: it has no tools)
    lora_name: str = ""  # the adapter it runs with ("": the base), as metrics label it
    choices: Choices = field(init=False)
    progress: JobProgress = field(init=False)  # its tokens since they were last saved
    resumed: dict[int, int] = field(default_factory=dict)  # by sample: tokens this attempt continued from
    engine_request: EngineRequest | None = None  # as handed to the engine (a refused resume: again, afresh)

    @property
    def key(self) -> JobKey:
        return JobKey(self.request.tenant, self.job_id)

    def __post_init__(self) -> None:
        tools = None
        if self.tool_dialect is not None:  # call ids: the same for the job whoever runs it
            tools = (self.tool_dialect, f"{self.request.tenant}/{self.job_id}")
        self.choices = Choices(self.request.n, self.logprob_format if self.request.logprobs else None, tools)
        self.progress = JobProgress(self.request.n)

    def on_tokens(
        self, count: int, text: str, index: int = 0, logprobs: Sequence[TokenLogprob] = ()
    ) -> float | None:
        """Record new output of sample `index` (`logprobs`: the engine's, one per token); returns the
        seconds since that sample's previous token (None for its first tokens)."""
        now = time.monotonic()
        sample = self.choices.add(index, count, text, logprobs)
        gap = None if not count or sample.last_token_mono is None else now - sample.last_token_mono
        if count and self.first_token_mono is None:
            self.first_token_mono = now
            self.first_token_at = self._wall(now)
        if count:
            sample.last_token_mono = self.last_token_mono = now
        return gap

    def on_resumed(self, index: int, count: int, text: str, logprobs: Sequence[TokenLogprob] = ()) -> None:
        """Sample `index` continues from `count` tokens an earlier attempt generated (and `text`): its
        output so far, which this attempt's timings do not count."""
        self.choices.add(index, count, text, logprobs)
        self.resumed[index] = count

    def on_end(self, index: int, reason: str) -> str | None:
        """Sample `index` ended; the job's finish reason once every sample has (or one ended the request)."""
        return self.choices.end(index, reason)

    @property
    def completion_tokens(self) -> int:
        return self.choices.completion_tokens

    def _wall(self, mono: float) -> datetime:
        return self.queued_at + timedelta(seconds=mono - self.queued_mono)

    def _timings(self, finished_at: datetime) -> Timings:
        def ms(later: datetime | None, earlier: datetime | None) -> float | None:
            if later is None or earlier is None:
                return None
            return max(0.0, (later - earlier).total_seconds() * 1000)

        # per sample: n samples decode side by side, one token each per step (this attempt's steps only:
        # the tokens it resumed from came before its first token)
        itl = None
        steps = max(s.tokens - self.resumed.get(s.index, 0) for s in self.choices.samples)
        if steps > 1 and self.first_token_mono is not None and self.last_token_mono:
            itl = (self.last_token_mono - self.first_token_mono) * 1000 / (steps - 1)
        return Timings(
            created_at=self.created_at,
            started_at=self.started_at,
            first_token_at=self.first_token_at,
            finished_at=finished_at,
            queue_ms=ms(self.started_at, self.created_at),
            ttft_ms=ms(self.first_token_at, self.created_at),
            mean_itl_ms=itl,
            e2e_ms=ms(finished_at, self.created_at),
        )

    def conclude(self, finish: str, worker_id: str, error: str | None = None) -> tuple[Terminal, Timings]:
        """The terminal row of how this attempt ended (its result is built from the stored row)."""
        finished_at = utcnow()
        timings = self._timings(finished_at)
        values = {"choices": self.choices.as_json(finish)} if self.choices.worth_storing else {}
        row = Terminal(
            job_id=self.job_id,
            status=STATUS_OF_FINISH.get(finish, "failed"),
            values={
                **values,
                "output_text": self.choices.text(0),
                "finish_reason": finish,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens,
                "worker_id": worker_id,
                "error": error,
                "started_at": self.started_at,
                "first_token_at": self.first_token_at,
                "finished_at": finished_at,
                "ttft_ms": timings.ttft_ms,
                "mean_itl_ms": timings.mean_itl_ms,
                "e2e_ms": timings.e2e_ms,
                "queue_ms": timings.queue_ms,
            },
            attempt=self.attempt,
            tenant=self.request.tenant,
        )
        return row, timings

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
        )
