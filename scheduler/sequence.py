"""One request's mutable state inside the scheduler (never crosses the scheduler boundary); the n > 1
samples of one request as a RequestGroup."""

from __future__ import annotations

import enum

from scheduler.types import FinishReason, Priority, SamplingParams, SequenceRequest

NO_BLOCK = -1  # a place in a block table whose block was given back (behind every layer's window)

PLACEHOLDER = -1  # a sampled token not known yet (its step is in flight): never fed to the model as such


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
        self.lora: str | None = request.lora
        self.arrival: float = request.arrival
        sampling = request.sampling
        # Any of these tokens ends the sequence; so does reaching max_num_tokens tokens in all.
        eos = frozenset() if sampling.ignore_eos else request.eos_token_ids
        self.stop_token_ids: frozenset[int] = eos | frozenset(sampling.stop_token_ids)
        self.max_num_tokens = len(request.prompt_token_ids) + sampling.max_tokens
        self.order = order  # admission counter: the last tie-breaker, so ordering is total and stable
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        resumed = request.resumed[index] if index < len(request.resumed) else ()
        self.token_ids += resumed
        # Positions from here on always run through the model, never served by a cache (the logits of
        # resumed tokens recompute their logprobs); None: only the last token must.
        self.logits_from: int | None = (
            self.num_prompt_tokens - 1 if resumed and request.resumed_logits else None
        )
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


class RequestGroup:
    """The n samples of one request: one prefills the prompt, the others fork from it sharing its KV.

    Every sample is a Sequence of its own (own tokens, block table, preemption and ending). Until the
    prompt is computed only one of them, the prefiller, runs; the others wait in the group holding
    nothing. Once the prefiller's prompt is computed they fork: each shares every full prompt block but
    the one holding the prompt's last token (the pool counts references, so a block outlives whichever
    sample frees it first) and computes only the rest itself, 1 to block_size tokens. Sharing only full,
    computed blocks means no shared block is ever written and none has to be copied on the device.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.members: list[Sequence] = []  # live samples, by index (the prefiller and the unforked too)
        self.unforked: list[Sequence] = []  # samples waiting for the prompt to be computed, by index

    def shared_prefix(self, seq: Sequence, block_size: int, window: int | None = None) -> list[int]:
        """The longest run of leading blocks some running sibling has computed that `seq`, holding no
        blocks yet, may share: prompt blocks only, and never the block of its own last token (it must
        compute at least one token to have logits). `window` (a model windowed on every layer): a run
        whose given-back blocks reach into what `seq` would still read from it is no use."""
        limit = min(seq.num_prompt_tokens, seq.num_tokens - 1) // block_size
        if seq.logits_from is not None:
            limit = min(limit, seq.logits_from // block_size)
        best: tuple[int, ...] = ()
        for other in self.members:
            if other is seq or other.status is not SequenceStatus.RUNNING:
                continue
            k = min(limit, other.num_computed_tokens // block_size, len(other.block_table))
            if k <= len(best):
                continue
            table = other.block_table[:k]
            if window is not None and table and table[0] == NO_BLOCK:
                given_back = next((i for i, b in enumerate(table) if b != NO_BLOCK), k)
                if given_back * block_size > k * block_size - window:  # its first query reads back there
                    continue
            best = table
        return list(best)

    def remove(self, seq: Sequence) -> None:
        self.members.remove(seq)
        if seq in self.unforked:
            self.unforked.remove(seq)
