"""The demo's board: each job's streamed text and timings as token events arrive, and how to show them.

Pure state and rendering (no Kafka): `DemoBoard.apply` takes token events, the render functions turn the
board into a live view (rich) or into plain blocks for logs and pipes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.text import Text

from schemas.jobs import TokenEvent
from workers.client.token_order import ContinuousOutput

PRIORITY_STYLE = {"high": "bold red", "normal": "bold yellow", "low": "bold blue"}


@dataclass(frozen=True)
class DemoJob:
    job_id: str
    priority: str
    tenant: str
    question: str
    submitted_s: float  # time.monotonic() when it was posted


@dataclass
class JobStream:
    """What this client has seen of one job: its text (continued across attempts that resumed it) and when
    its tokens came."""

    job: DemoJob
    text: str = ""
    attempt: int = -1
    seqs: set[int] = field(default_factory=set)
    tokens: int = 0
    first_token_s: float | None = None
    finished_s: float | None = None
    finish_reason: str | None = None
    output: ContinuousOutput = field(default_factory=ContinuousOutput)  # each position's text once

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft_ms(self) -> float | None:
        """Time to first token as this client saw it: from posting to the first event with a token."""
        return None if self.first_token_s is None else (self.first_token_s - self.job.submitted_s) * 1000

    @property
    def tokens_per_s(self) -> float | None:
        """Generation speed after the first token (None until there is a span to measure)."""
        if self.first_token_s is None or self.finished_s is None or self.finished_s <= self.first_token_s:
            return None
        return max(self.tokens - 1, 0) / (self.finished_s - self.first_token_s)


class DemoBoard:
    def __init__(self, jobs: list[DemoJob]) -> None:
        self.streams = {job.job_id: JobStream(job) for job in jobs}

    def apply(self, event: TokenEvent, now: float) -> JobStream | None:
        """Take one token event; the job's stream if it changed (duplicates, stale attempts: no news)."""
        stream = self.streams.get(event.job_id)
        if (
            stream is None
            or event.attempt < stream.attempt
            or (stream.done and event.attempt == stream.attempt)
        ):
            return None
        if event.attempt > stream.attempt:  # another worker took the job over: it continues the text
            stream.attempt, stream.seqs = event.attempt, set()
        if event.seq in stream.seqs:
            return None  # the producer retried a send
        stream.seqs.add(event.seq)
        new = stream.output.take(event)  # what the resumed attempt sends again is not news
        if new is None:
            return None
        if new.restarted:  # an attempt that could not resume: the text starts again
            self.streams[event.job_id] = stream = JobStream(
                stream.job, attempt=event.attempt, seqs=stream.seqs, output=stream.output
            )
        stream.text += new.text
        stream.tokens += len(new.token_ids)
        if event.token_ids and stream.first_token_s is None:
            stream.first_token_s = now
        if event.final:  # the job's end (with n > 1, a sample's finish_reason is not)
            stream.finish_reason = event.finish_reason
            stream.finished_s = now
            if event.usage is not None:
                stream.tokens = event.usage.completion_tokens
        return stream

    @property
    def done(self) -> bool:
        return all(s.done for s in self.streams.values())

    def texts(self) -> dict[str, str]:
        return {job_id: s.text for job_id, s in self.streams.items()}


def status_line(stream: JobStream) -> str:
    if not stream.done:
        return "streaming…" if stream.first_token_s is not None else "waiting…"
    parts = [f"{stream.tokens} tokens", f"finish {stream.finish_reason}"]
    if stream.ttft_ms is not None:
        parts.insert(0, f"TTFT {stream.ttft_ms:,.0f} ms")
    if stream.tokens_per_s is not None:
        parts.insert(1, f"{stream.tokens_per_s:.1f} tok/s")
    return " · ".join(parts)


def title(job: DemoJob) -> str:
    return f"{job.priority} · {job.tenant} · {job.job_id}"


def render_live(board: DemoBoard) -> RenderableType:
    """One panel per job whose text grows in place; priority and tenant in the title, timings below."""
    panels = []
    for stream in board.streams.values():
        job = stream.job
        body = Text()
        body.append(f"Q: {job.question}\n", style="dim")
        body.append(stream.text or " ")
        heading = Text.assemble(
            (job.priority, PRIORITY_STYLE.get(job.priority, "bold")), f" · {job.tenant} · {job.job_id}"
        )
        style = "green" if stream.done else "white"
        panels.append(
            Panel(body, title=heading, title_align="left", subtitle=status_line(stream), border_style=style)
        )
    return Group(*panels)


def render_plain(stream: JobStream) -> str:
    """A finished job as one plain block, for output that is not a terminal."""
    return f"[{title(stream.job)}] {stream.job.question}\n{stream.text}\n({status_line(stream)})\n"
