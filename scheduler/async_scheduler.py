"""Async scheduling's scheduler: a step's results applied in two halves, so the next step can be scheduled
while this one runs. `advance` (every chunk's tokens count as computed, a PLACEHOLDER stands for each token
in flight) and `commit` (the real tokens in, EOS, stop tokens and max_tokens applied); `rollback` undoes
advanced steps that failed. Synchronous steps use Scheduler.update_in_order (one pass), which this class
inherits with everything else: an engine may switch between the two modes between steps.

As vLLM's AsyncScheduler(Scheduler), a subclass, so its use of the scheduler's state (`_seqs`, `kv`,
`_last_in_flight`, `_end`, `_fork`, `_preempt`) is checked against the class that owns it.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from scheduler.output import ScheduledChunk, SchedulerOutput, TokenUpdate
from scheduler.scheduler import Scheduler
from scheduler.sequence import PLACEHOLDER, Sequence, SequenceStatus
from scheduler.types import FinishReason

__all__ = ["PLACEHOLDER", "AsyncScheduler", "PendingTokens"]


@dataclass(slots=True)
class PendingTokens:
    """The sampling chunks of an advanced step, in order: which sequence and where its token goes."""

    seq_ids: list[str]
    seqs: list[Sequence | None]  # None: the sequence had ended before the step was advanced
    positions: list[int]  # index of the PLACEHOLDER in the sequence's token_ids


class AsyncScheduler(Scheduler):
    """A Scheduler whose steps' results may also be applied in two halves (see the module docstring)."""

    def advance(self, output: SchedulerOutput) -> PendingTokens:
        """The step ran (or is running): every chunk's tokens count as computed, and each sampling chunk's
        sequence gets a PLACEHOLDER token, so the next step can be scheduled before the tokens are known
        (async scheduling). `commit` puts the real tokens in and applies the stop conditions."""
        seqs, running = self._seqs, SequenceStatus.RUNNING
        block_size, caching, max_model_len = (
            self.config.block_size,
            self.kv.enable_caching,
            self.config.max_model_len,
        )
        windowed = self.kv.window is not None
        pending = PendingTokens([], [], [])
        add_id, add_seq, add_position = pending.seq_ids.append, pending.seqs.append, pending.positions.append
        for chunk in output.chunks:
            seq = seqs.get(chunk.seq_id)
            if seq is None or seq.status is not running:
                if chunk.sample:  # ended (aborted, finished) between schedule() and now: keep the alignment
                    add_id(chunk.seq_id)
                    add_seq(None)
                    add_position(0)
                continue
            if seq.num_computed_tokens != chunk.start_position:
                raise ValueError(f"chunk of {chunk.seq_id!r} does not continue the sequence (stale output?)")
            computed = seq.num_computed_tokens = chunk.start_position + len(chunk.token_ids)
            # A sampling chunk's last token may itself be a placeholder: its blocks are cached on commit.
            if caching and not chunk.sample and computed // block_size > seq.num_cached_blocks:
                self.kv.cache_full_blocks(seq)  # a block just filled up
            if seq.group is not None and seq.group.unforked and computed >= seq.num_prompt_tokens:
                self._fork(seq)  # before its token may end it: the siblings take their blocks first
            if windowed:  # the step being advanced has its tables already, and a block given back now is
                self.kv.release_behind_window(seq)  # written again only by a later step, after it ran
            if not chunk.sample:
                continue
            tokens = seq.token_ids
            add_id(chunk.seq_id)
            add_seq(seq)
            add_position(len(tokens))
            tokens.append(PLACEHOLDER)
            if len(tokens) >= seq.max_num_tokens or len(tokens) >= max_model_len:
                self._last_in_flight.add(seq)  # that token ends it: never feed it back
        return pending

    def commit(self, pending: PendingTokens, tokens: SequenceOf[int]) -> list[TokenUpdate]:
        """The tokens of an advanced step, in its sampling chunks' order: placeholders replaced, EOS, stop
        tokens and max_tokens applied. A sequence that ended since (abort, deadline, a stop found in an
        earlier step's output) drops its token."""
        updates = []
        finished, running = SequenceStatus.FINISHED, SequenceStatus.RUNNING
        caching, block_size, max_model_len = (
            self.kv.enable_caching,
            self.config.block_size,
            self.config.max_model_len,
        )
        for seq, position, token in zip(pending.seqs, pending.positions, tokens, strict=True):
            if seq is None or seq.status is finished:
                continue
            if token < 0:
                raise KeyError(f"no sampled token for {seq.seq_id!r}, whose chunk asked for one")
            seq.token_ids[position] = token
            num_tokens = position + 1
            if token in seq.stop_token_ids:
                reason: FinishReason | None = FinishReason.STOP
            elif num_tokens >= seq.max_num_tokens or num_tokens >= max_model_len:
                reason = FinishReason.LENGTH
            else:
                reason = None
            if reason is not None:
                del seq.token_ids[num_tokens:]  # a placeholder the next step ran for it: discarded
                self._end(seq, reason)
            elif (
                caching
                and seq.status is running
                and seq.num_computed_tokens // block_size > seq.num_cached_blocks
            ):
                self.kv.cache_full_blocks(seq)  # every token before num_computed_tokens is real now
            updates.append(TokenUpdate(seq.seq_id, token, reason))
        return updates

    def rollback(self, chunks: SequenceOf[ScheduledChunk], now: float) -> list[str]:
        """Advanced steps that failed: their sequences drop their placeholder tokens, and those holding KV
        blocks (n > 1: with their samples) are preempted, since the KV those steps wrote is unknown. The
        sequences preempted, whose runner state must go."""
        preempted: list[str] = []
        for chunk in chunks:
            seq = self._seqs.get(chunk.seq_id)
            if seq is None:
                continue
            tokens = seq.token_ids
            while len(tokens) > seq.num_prompt_tokens and tokens[-1] == PLACEHOLDER:
                tokens.pop()
            self._last_in_flight.discard(seq)
            for member in seq.group.members if seq.group is not None else (seq,):
                if member.status is SequenceStatus.RUNNING:
                    self._preempt(member, now)
                    preempted.append(member.seq_id)
        return preempted
