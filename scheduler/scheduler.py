"""Iteration-level scheduler: each step lets every sequence's num_computed_tokens catch up with its tokens.

A step, in order: end what expired or can never fit → promote aged waiting sequences → free seats and
KV blocks for better-class waiting work (preempting worse-class running sequences) → schedule running
sequences (decode tokens first, then the rest of their prefills, capped while better-class work waits;
preempt the lowest-class, latest-arrived one when KV blocks run out) → admit waiting sequences with
prefill chunks into the remaining token budget.

A request with n > 1 samples is one sequence per sample in a RequestGroup: one prefills, and when its
prompt is computed the others fork from it, sharing the prompt's KV blocks (scheduler/sequence.py).

A step's results (`update_in_order`): computed tokens advance, sampled tokens are appended, and EOS, stop
tokens and max_tokens end sequences. Async scheduling applies them in two halves (placeholders first) in
the subclass scheduler/async_scheduler.py.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from scheduler.adapter_slots import AdapterSlots
from scheduler.budget import TokenBudget
from scheduler.config import SchedulerConfig
from scheduler.deadlines import DeadlineHeap
from scheduler.fairness import TenantLedger
from scheduler.kv_manager import KVCacheManager
from scheduler.limits import check_config, why_never_fits
from scheduler.output import FinishedSequence, ScheduledChunk, SchedulerOutput, TokenUpdate
from scheduler.preemption import block_victims, decodes_deferred_after, lora_victims, seat_victims
from scheduler.sequence import PLACEHOLDER, RequestGroup, Sequence, SequenceStatus
from scheduler.types import FinishReason, Priority, SequenceRequest, sample_seq_id
from scheduler.waiting_queue import WaitingQueue

# Sequences an admission pass looks past at most (each waits for a LoRA adapter slot): bounds a step's
# work when thousands wait; the first of them keeps its turn, so none waits for ever.
LORA_LOOKAHEAD = 1024


@dataclass(frozen=True)
class SchedulerStats:
    running: int
    waiting: dict[Priority, int]
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int  # total since start
    prefix_cache_hits: int  # tokens served from the prefix cache (or a sibling sample), total since start
    prompt_tokens_computed: int  # prompt tokens run through the model, total since start (recompute too)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        check_config(config)
        self.config = config
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.share_prefix_cache_across_tenants,
            config.kv_window,
        )
        self._ledger = TenantLedger()
        self._waiting = WaitingQueue(self._ledger, config.aging_s)
        self._running: list[Sequence] = []
        self._running_sorted = True  # removals keep the order; an admission appends out of order
        self._seqs: dict[str, Sequence] = {}  # every live (waiting, running or unforked) sequence
        self._groups: dict[str, RequestGroup] = {}  # request id -> its samples, for live n > 1 requests
        self._deadlines = DeadlineHeap()
        self._rejected: list[FinishedSequence] = []  # refused by add(), reported by the next schedule()
        self._order = itertools.count()
        self._num_preemptions = 0
        self._prefix_hit_tokens = 0
        self._prompt_tokens_computed = 0
        self._deferred_last_step = False
        # Sequences whose in-flight token is their last (max_tokens, max_model_len): not scheduled again.
        # Filled by AsyncScheduler.advance; always empty for synchronous steps.
        self._last_in_flight: set[Sequence] = set()
        self._adapters = AdapterSlots(config.max_loras)  # LoRA: which adapters run, which one drains

    # ---- requests in and out -------------------------------------------------------------------------

    def add(self, request: SequenceRequest) -> None:
        """Queue a request (n > 1: its first sample; the others wait for its prompt, then fork). A request
        that can never fit is ended as REJECTED, every sample of it, by the next schedule()."""
        seq_ids = [sample_seq_id(request.seq_id, i) for i in range(max(request.n, 1))]
        if request.seq_id in self._groups or any(seq_id in self._seqs for seq_id in seq_ids):
            raise ValueError(f"sequence {request.seq_id!r} (or a sample of it) is already queued or running")
        reason = why_never_fits(request, self.config)
        if reason:
            self._rejected += [FinishedSequence(i, FinishReason.REJECTED, reason) for i in seq_ids]
            return
        if request.n == 1:
            self._enter(Sequence(request, next(self._order)))
            return
        group = self._groups[request.seq_id] = RequestGroup(request.seq_id)
        for index, seq_id in enumerate(seq_ids):
            sample = dataclasses.replace(request, seq_id=seq_id) if index else request
            seq = Sequence(sample, next(self._order), group, index)
            group.members.append(seq)
            if index:
                seq.status = SequenceStatus.AWAITING_FORK
                group.unforked.append(seq)
            self._enter(seq)

    def refuse(self, request: SequenceRequest, reason: str) -> None:
        """End a request the caller cannot run (e.g. its LoRA adapter does not load) as REJECTED, every
        sample of it, by the next schedule()."""
        seq_ids = [sample_seq_id(request.seq_id, i) for i in range(max(request.n, 1))]
        self._rejected += [FinishedSequence(i, FinishReason.REJECTED, reason) for i in seq_ids]

    def _enter(self, seq: Sequence) -> None:
        self._seqs[seq.seq_id] = seq
        self._ledger.join(seq.tenant)
        if seq.status is SequenceStatus.WAITING:
            self._waiting.add(seq)
        if seq.request.deadline is not None:
            self._deadlines.add(seq, seq.request.deadline)

    def abort(self, seq_id: str) -> FinishedSequence | None:
        """Cancel a waiting or running sequence now (blocks freed); None if unknown or already ended."""
        return self.finish(seq_id, FinishReason.ABORT)

    def abort_request(self, request_id: str) -> list[FinishedSequence]:
        """Cancel every live sample of a request, in index order (empty if none is live)."""
        members = self._members(request_id)
        if members and members[0].group is not None:
            members[0].group.unforked.clear()  # all of them end: no sample takes the prefill over
        return [self._end(seq, FinishReason.ABORT) for seq in members]

    def _members(self, request_id: str) -> list[Sequence]:
        """The live samples of a request, by index."""
        group = self._groups.get(request_id)
        if group is not None:
            return list(group.members)
        seq = self._seqs.get(request_id)
        return [seq] if seq is not None and seq.group is None else []

    def finish(self, seq_id: str, reason: FinishReason) -> FinishedSequence | None:
        """End a running sequence for a reason found outside (e.g. a stop string matched by the engine)."""
        seq = self._seqs.get(seq_id)
        return None if seq is None else self._end(seq, reason)

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._rejected)

    def running_ids(self) -> list[str]:
        return [seq.seq_id for seq in self._running]

    def running_request_ids(self) -> list[str]:
        """Requests with a sample holding a seat, each once."""
        return list(dict.fromkeys(seq.request_id for seq in self._running))

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self._running),
            waiting=self._waiting.counts(),
            kv_blocks_used=self.kv.pool.num_used,
            kv_blocks_total=self.kv.num_blocks,
            preemptions=self._num_preemptions,
            prefix_cache_hits=self._prefix_hit_tokens,
            prompt_tokens_computed=self._prompt_tokens_computed,
        )

    def sequence(self, seq_id: str) -> Sequence | None:
        """The live sequence with this id (read it, do not change it); None once it has ended."""
        return self._seqs.get(seq_id)

    def running_sequences(self) -> tuple[Sequence, ...]:
        """Sequences holding a seat (and KV blocks), best class first as of the last schedule()."""
        return tuple(self._running)

    def waiting_sequences(self) -> tuple[Sequence, ...]:
        """Queued sequences, in no particular order (they hold no KV blocks)."""
        return tuple(self._waiting)

    def live_sequences(self) -> tuple[Sequence, ...]:
        """Every sequence not ended: running, waiting, and samples waiting for their fork (no blocks)."""
        return tuple(self._seqs.values())

    # ---- one step ------------------------------------------------------------------------------------

    def schedule(self, now: float, only: str | None = None) -> SchedulerOutput:
        """Pick this step's chunks under the token, sequence and KV-block budgets.

        `only`: run that request's running samples alone (the others wait, keeping their blocks; nothing
        is admitted), as a worker does to find which request makes its steps fail."""
        finished, self._rejected = self._rejected, []
        finished += self._expire(now)
        if only is not None:
            return self._schedule_alone(only, finished)
        self._waiting.promote_aged(now)
        preempted = self._preempt_for_priority(now)
        budget = TokenBudget(self.config.max_num_batched_tokens)
        decodes, prefills, kv_preempted = self._schedule_running(now, budget, self._decodes_deferred_after())
        preempted += kv_preempted
        if not kv_preempted:  # blocks just ran out: admitting now would only preempt again
            for chunk in self._admit_waiting(budget):
                (prefills if _is_prefill(chunk) else decodes).append(chunk)
        return SchedulerOutput(
            chunks=(*decodes, *prefills),  # each group in scheduling order
            num_tokens=budget.used,
            preempted=tuple(preempted),
            finished=tuple(finished),
            num_decodes=len(decodes),
        )

    # ---- a step's results ----------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> list[TokenUpdate]:
        """Advance num_computed_tokens for every chunk, append sampled tokens, detect EOS/stop/max_tokens."""
        return self.update_in_order(
            output, [sampled.get(c.seq_id, PLACEHOLDER) for c in output.chunks if c.sample]
        )

    def update_in_order(self, output: SchedulerOutput, tokens: SequenceOf[int]) -> list[TokenUpdate]:
        """`update` with the sampled tokens in the order of the chunks that sample (as the runner returns
        them): `advance` and `commit` at once, in one pass (the synchronous step's common path)."""
        updates = []
        seqs, running = self._seqs, SequenceStatus.RUNNING
        block_size, caching = self.config.block_size, self.kv.enable_caching
        max_model_len = self.config.max_model_len
        windowed = self.kv.window is not None
        chunks = output.chunks
        # Decode chunks always sample: an all-decode step (the common one) needs no count.
        sampling = len(chunks) if output.num_decodes == len(chunks) else sum(1 for c in chunks if c.sample)
        if len(tokens) != sampling:
            raise ValueError(
                f"{len(tokens)} sampled tokens for a step whose chunks sample a different number"
            )
        next_token = iter(tokens).__next__
        for chunk in output.chunks:
            seq = seqs.get(chunk.seq_id)
            if seq is None or seq.status is not running:
                if chunk.sample:
                    next_token()  # ended (aborted, finished) between schedule() and update(): dropped
                continue
            if seq.num_computed_tokens != chunk.start_position:
                raise ValueError(f"chunk of {chunk.seq_id!r} does not continue the sequence (stale output?)")
            computed = seq.num_computed_tokens = chunk.start_position + len(chunk.token_ids)
            if caching and computed // block_size > seq.num_cached_blocks:  # a block just filled up
                self.kv.cache_full_blocks(seq)
            if seq.group is not None and seq.group.unforked and computed >= seq.num_prompt_tokens:
                self._fork(seq)  # before its token may end it: the siblings take their blocks first
            if windowed:  # after caching (a block is registered before it goes) and forking (siblings
                self.kv.release_behind_window(seq)  # start behind this one: they hold their own refs)
            if not chunk.sample:
                continue
            token = next_token()
            if token < 0:
                raise KeyError(f"no sampled token for {chunk.seq_id!r}, whose chunk asked for one")
            tokens = seq.token_ids
            tokens.append(token)
            # stop_reason(), inline: this runs per row per step
            if token in seq.stop_token_ids:
                reason: FinishReason | None = FinishReason.STOP
            elif len(tokens) >= seq.max_num_tokens or len(tokens) >= max_model_len:
                reason = FinishReason.LENGTH
            else:
                reason = None
            if reason is not None:
                self._end(seq, reason)
            updates.append(TokenUpdate(chunk.seq_id, token, reason))
        return updates

    # ---- steps of schedule() -------------------------------------------------------------------------

    def _schedule_alone(self, request_id: str, finished: list[FinishedSequence]) -> SchedulerOutput:
        budget = TokenBudget(self.config.max_num_batched_tokens)
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        for seq in self._members(request_id):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            uncomputed = seq.num_uncomputed_tokens
            n = min(uncomputed, budget.left)
            if n > 0 and self.kv.allocate(seq, n) is not None:  # its own blocks, or free ones: no victims
                chunk = self._chunk(seq, n, budget)
                (decodes if uncomputed == 1 and chunk.num_generated else prefills).append(chunk)
        return SchedulerOutput(
            chunks=(*decodes, *prefills),
            num_tokens=budget.used,
            preempted=(),
            finished=tuple(finished),
            num_decodes=len(decodes),
        )

    def _expire(self, now: float) -> list[FinishedSequence]:
        return [
            self._end(seq, FinishReason.EXPIRED, "deadline passed")
            for seq in self._deadlines.pop_expired(now)
        ]

    def _preempt_for_priority(self, now: float) -> list[str]:
        """Make seats, then KV blocks, for waiting work of a strictly better class than running work. A head
        waiting for a LoRA adapter slot first gets one from worse-class work, or nothing is preempted
        (seats and blocks made now would only go to others)."""
        head = self._waiting.peek()
        freed: list[Sequence] = []  # an adapter's sequences, preempted for the head's slot
        if head is not None and self._adapters.needs_slot(head.lora):
            freed = lora_victims(head, self._running)
            if not freed:
                return []
            for victim in freed:
                self._preempt(victim, now)
        victims = seat_victims(self._running, self._waiting, self.config.max_num_seqs)
        for victim in victims:
            self._preempt(victim, now)
        victims = freed + victims
        head = self._waiting.peek()
        if head is not None and len(self._running) < self.config.max_num_seqs:
            cached = self._cached_prefix(head)
            more = block_victims(head, cached, self._running, self.kv, self.config.max_num_batched_tokens)
            for victim in more:
                self._preempt(victim, now)
            victims += more
        return [victim.seq_id for victim in victims]

    def _decodes_deferred_after(self) -> Priority | None:
        """The class whose prefill this step serves first (worse-class decodes sit it out), or None.
        Never two steps in a row, so worse-class work keeps at least half its decode rate."""
        if not self.config.defer_worse_decodes or self._deferred_last_step:
            self._deferred_last_step = False
            return None
        seat_free = len(self._running) < self.config.max_num_seqs  # else the head cannot start this step
        head = self._waiting.peek() if seat_free else None
        deferred_after = decodes_deferred_after(head, self._running)
        self._deferred_last_step = deferred_after is not None
        return deferred_after

    def _schedule_running(
        self, now: float, budget: TokenBudget, deferred_after: Priority | None = None
    ) -> tuple[list[ScheduledChunk], list[ScheduledChunk], list[str]]:
        """Give each running sequence its next tokens, best class first; decodes are never crowded out
        (only deferred for one step when `deferred_after` says so). Returns decode chunks, prefill
        chunks and the sequences preempted for KV blocks."""
        if not self._running_sorted:
            self._running.sort(key=Sequence.sort_key)
            self._running_sorted = True
        running = self._running

        def deferred(seq: Sequence) -> bool:
            return deferred_after is not None and seq.queue_class > deferred_after

        # Decodes still to come after the current sequence: counted when a prefill first needs to leave
        # them a token each (an all-decode step never does).
        decodes_left: int | None = None
        cap = self.config.long_prefill_cap
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        preempted: list[str] = []
        block_size, charge, chunk_of = self.config.block_size, self._ledger.charge, ScheduledChunk
        last_in_flight = self._last_in_flight
        # Decode tokens served but not yet charged to their tenant (the ledger is only read when admitting).
        run_tenant: str | None = None
        run_length = 0
        i = 0
        while i < len(running):
            seq = running[i]
            tokens = seq.token_ids
            computed = seq.num_computed_tokens
            uncomputed = len(tokens) - computed
            if uncomputed == 1:
                if (deferred_after is not None and seq.queue_class > deferred_after) or (
                    last_in_flight and seq in last_in_flight
                ):
                    i += 1
                    continue
                if decodes_left is not None:
                    decodes_left -= 1
                if (
                    computed >= seq.num_prompt_tokens
                    and computed < len(seq.block_table) * block_size
                    and budget.used < budget.limit
                ):
                    # The common decode: past the prompt, its last block has room. What allocate() and
                    # _chunk() would do, without their calls (this runs per row per step).
                    budget.used += 1
                    if seq.tenant is run_tenant:  # charged per run of one tenant's decodes, not per row
                        run_length += 1
                    else:
                        if run_length:
                            charge(run_tenant, run_length)
                        run_tenant, run_length = seq.tenant, 1
                    decodes.append(
                        chunk_of(
                            seq.seq_id,
                            (tokens[computed],),
                            computed,
                            seq.block_table,
                            True,
                            seq.sampling,
                            computed + 1 - seq.num_prompt_tokens,
                            seq.lora,
                        )
                    )
                    i += 1
                    continue
                n = min(1, budget.left)
            else:  # the rest of a prefill, leaving one token for each decode still to come
                if decodes_left is None:
                    decodes_left = sum(
                        1 for s in running[i + 1 :] if s.num_uncomputed_tokens == 1 and not deferred(s)
                    )
                n = min(uncomputed, budget.left - decodes_left)
                if cap and self._waiting.num_better_than(seq.queue_class):
                    n = min(n, cap)  # a long prefill must not take the budget better-class work needs
            if n <= 0:
                i += 1
                continue
            while self.kv.allocate(seq, n) is None:
                victim = running[-1]  # lowest class, latest arrival, not yet scheduled
                if (
                    decodes_left is not None
                    and victim is not seq
                    and victim.num_uncomputed_tokens == 1
                    and not deferred(victim)
                ):
                    decodes_left -= 1
                self._preempt(victim, now)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            else:
                chunk = self._chunk(seq, n, budget)
                # One token reaching the end of a sequence past its prompt is a decode; nothing else is.
                (decodes if uncomputed == 1 and chunk.num_generated else prefills).append(chunk)
                i += 1
        if run_length:
            charge(run_tenant, run_length)
        return decodes, prefills, preempted

    def _admit_waiting(self, budget: TokenBudget) -> list[ScheduledChunk]:
        """Admit in queue order while tokens, seats and blocks allow; stop at the first that does not fit.

        LoRA: a sequence whose adapter cannot enter (max_loras adapters running already) is looked past,
        keeping its place, and so are, behind it, the sequences of one running adapter chosen to drain
        (`AdapterSlots.drain_one`): that adapter leaves once its sequences end, and the first waiting sequence
        that needs a slot takes it. Others behind it are admitted meanwhile (base sequences, other running
        adapters'), so the batch stays full and no sequence waits for ever."""
        chunks: list[ScheduledChunk] = []
        waiting, adapters = self._waiting, self._adapters
        blocked = False  # a sequence waits for an adapter slot, ahead of those looked at now
        skipped = 0
        try:
            while budget.left > 0 and len(self._running) < self.config.max_num_seqs:
                seq = waiting.peek()
                if seq is None:
                    if not blocked:
                        adapters.draining = None  # nothing waits for a slot any more
                    break
                if seq in self._last_in_flight:  # its last token is in flight: it is ending
                    break
                if seq.lora is not None and (
                    adapters.needs_slot(seq.lora) or (blocked and seq.lora == adapters.draining)
                ):
                    if not blocked and adapters.draining is None and adapters.running:
                        adapters.drain_one(s.lora for s in waiting)
                    blocked = True
                    skipped += 1
                    if skipped > LORA_LOOKAHEAD:  # bounded work per step; the head keeps its turn
                        break
                    waiting.set_aside(seq)
                    continue
                if not self._admit(seq, budget, chunks):
                    break
        finally:
            waiting.restore()
        return chunks

    def _admit(self, seq: Sequence, budget: TokenBudget, chunks: list[ScheduledChunk]) -> bool:
        """Admit the head of the waiting queue with its first chunk, if its blocks fit."""
        cached = self._cached_prefix(seq)
        num_cached_tokens = len(cached) * self.kv.block_size
        n = min(seq.num_tokens - num_cached_tokens, budget.left)
        if self.kv.allocate(seq, n, cached) is None:
            return False
        self._waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self._running.append(seq)
        self._adapters.enter(seq.lora)
        self._running_sorted = False
        self._prefix_hit_tokens += num_cached_tokens
        chunks.append(self._chunk(seq, n, budget))
        return True

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Leading blocks a sequence about to be admitted can share: prefix-cache hits, or a running
        sibling sample's prompt blocks (shared whether or not prefix caching is on), the longer."""
        cached = self.kv.find_cached_prefix(seq)
        if seq.group is not None:
            shared = seq.group.shared_prefix(seq, self.kv.block_size, self.kv.window)
            if len(shared) > len(cached):
                return shared
        return cached

    def _chunk(self, seq: Sequence, n: int, budget: TokenBudget) -> ScheduledChunk:
        start = seq.num_computed_tokens
        budget.take(n)
        if start < seq.num_prompt_tokens:
            self._prompt_tokens_computed += min(n, seq.num_prompt_tokens - start)
        self._ledger.charge(seq.tenant, n)
        tokens = seq.token_ids
        return ScheduledChunk(
            seq.seq_id,
            (tokens[start],) if n == 1 else tuple(tokens[start : start + n]),
            start,
            seq.block_table,
            start + n == len(tokens),
            seq.sampling,
            len(tokens) - seq.num_prompt_tokens,
            seq.lora,
        )

    # ---- sequence transitions ------------------------------------------------------------------------

    def _preempt(self, seq: Sequence, now: float) -> None:
        """Recompute-style preemption: drop its KV, keep its tokens, back to the front of its class."""
        self._running.remove(seq)
        self._adapters.leave(seq.lora)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self._num_preemptions += 1
        self._waiting.push_front(seq, now)

    def _fork(self, source: Sequence) -> None:
        """`source` just computed the prompt: its unforked siblings start from it, sharing its full prompt
        blocks, while seats last (the others queue, and share with a running sibling when admitted)."""
        group = source.group
        assert group is not None
        for child in group.unforked:
            if len(self._running) < self.config.max_num_seqs:
                # Takes no free block: sharing can never fail, and the tail is allocated when scheduled.
                self.kv.allocate(child, 0, group.shared_prefix(child, self.kv.block_size, self.kv.window))
                child.status = SequenceStatus.RUNNING
                self._running.append(child)
                self._adapters.enter(child.lora)
                self._running_sorted = False
            else:
                child.status = SequenceStatus.WAITING
                self._waiting.add(child)
        group.unforked.clear()

    def _end(self, seq: Sequence, reason: FinishReason, detail: str = "") -> FinishedSequence:
        """The one place a live sequence ends: its blocks are freed here, exactly once."""
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
            self._adapters.leave(seq.lora)
            self.kv.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)  # waiting sequences hold no blocks
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._last_in_flight.discard(seq)
        del self._seqs[seq.seq_id]
        self._deadlines.discard(seq)
        self._ledger.leave(seq.tenant)
        if seq.group is not None:
            self._leave_group(seq)
        return FinishedSequence(seq.seq_id, reason, detail)

    def _leave_group(self, seq: Sequence) -> None:
        group = seq.group
        assert group is not None
        was_unforked = seq in group.unforked
        group.remove(seq)
        if group.unforked and not was_unforked:
            # The prefiller ended before the prompt was computed: the next sample prefills instead.
            heir = group.unforked.pop(0)
            heir.status = SequenceStatus.WAITING
            self._waiting.add(heir)
        if not group.members:
            del self._groups[group.request_id]


def _is_prefill(chunk: ScheduledChunk) -> bool:
    """Anything but a decode step (one token continuing a sequence already past its prompt)."""
    return not (len(chunk.token_ids) == 1 and chunk.sample and chunk.num_generated > 0)
