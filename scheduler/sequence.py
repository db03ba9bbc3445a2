"""One request's mutable state inside the scheduler (never crosses the scheduler boundary)."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from scheduler.types import FinishReason, Priority, SamplingParams, SequenceRequest

if TYPE_CHECKING:
    from scheduler.request_group import RequestGroup


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    AWAITING_FORK = "awaiting_fork"  # a sample of n > 1 waiting for its prompt's KV (holds nothing)
    FINISHED = "finished"


class Sequence:
    """Prompt + output tokens, and how many of them already have KV in the cache.

    The one rule: each step computes tokens[num_computed_tokens : ...] until num_computed_tokens catches up
    with len(token_ids). Prefill, chunked prefill, decode and recompute after preemption are all that rule.
    """

    def __init__(
        self, request: SequenceRequest, order: int, group: RequestGroup | None = None, index: int = 0
    ) -> None:
        self.request = request
        # The request's fields read every step, as plain attributes (a request never changes).
        self.seq_id: str = request.seq_id
        # One of the n samples of a request (None for n = 1): which one, and the request's own id.
        self.group = group
        self.index = index
        self.request_id: str = group.request_id if group is not None else request.seq_id
        self.sampling: SamplingParams = request.sampling
        self.tenant: str = request.tenant
        self.arrival: float = request.arrival
        sampling = request.sampling
        # Any of these tokens ends the sequence; so does reaching max_num_tokens tokens in all.
        eos = frozenset() if sampling.ignore_eos else request.eos_token_ids
        self.stop_token_ids: frozenset[int] = eos | frozenset(sampling.stop_token_ids)
        self.max_num_tokens = len(request.prompt_token_ids) + sampling.max_tokens
        self.order = order  # admission counter: the last tie-breaker, so ordering is total and stable
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        # Replaced, never changed in place, when blocks come or go: a chunk hands it on without copying.
        self.block_table: tuple[int, ...] = ()
        self.num_cached_blocks = 0  # leading blocks of block_table already registered in the prefix cache
        self.block_hashes: list[bytes] = []  # chained prefix keys of full blocks: lazy, kept on preemption
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        # Waiting-queue bookkeeping: the class it is served in now (aging may promote it), since when it
        # has been in that class, and a token that invalidates stale queue entries when the sequence moves.
        self.queue_class: Priority = request.priority
        self.class_since: float = request.arrival
        self.queue_token = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        """Priority order: class, then arrival, then admission order (smaller is served first)."""
        return (int(self.queue_class), self.arrival, self.order)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.status.value}, class={self.queue_class.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, blocks={len(self.block_table)})"
        )
