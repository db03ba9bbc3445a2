"""The whole scheduler → runner contract for one step, and what flows back."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.types import FinishReason, SamplingParams


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens of one sequence to run through the model in this step.

    Read-only by convention: not frozen, because every step builds one per running sequence and a frozen
    dataclass costs several times as much to build.
    """

    seq_id: str
    token_ids: tuple[int, ...]  # tokens[num_computed_tokens : num_computed_tokens + n] of the sequence
    start_position: int  # position of token_ids[0] (= num_computed_tokens before this step)
    # Every KV block of the sequence, in order, covering start_position + n. The very tuple the sequence
    # holds: the same object from step to step until the sequence gains or loses blocks.
    block_table: tuple[int, ...]
    sample: bool  # the chunk reaches the sequence's last token, so the runner samples the next one
    sampling: SamplingParams
    num_generated: int  # output tokens so far: with the seed it makes sampling reproducible per request
    lora: str | None = None  # the LoRA adapter the sequence runs under (SequenceRequest.lora); None: base


@dataclass(frozen=True)
class FinishedSequence:
    seq_id: str
    reason: FinishReason
    detail: str = ""  # human-readable reason (e.g. why a request was rejected)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]  # decode chunks first, then prefill chunks
    num_tokens: int  # sum of len(chunk.token_ids): never above the step's token budget
    preempted: tuple[str, ...]  # sequences preempted this step (blocks freed; recomputed later)
    # ended while scheduling (expired, rejected); abort() and finish() return theirs directly
    finished: tuple[FinishedSequence, ...]
    # The first num_decodes chunks are the decode chunks: one token continuing a sequence past its prompt.
    num_decodes: int

    @property
    def empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class TokenUpdate:
    """What `Scheduler.update` reports per sampled sequence (read-only by convention, as ScheduledChunk)."""

    seq_id: str
    token_id: int
    finish: FinishReason | None  # set when this token ended the sequence (EOS, stop token, max_tokens)
