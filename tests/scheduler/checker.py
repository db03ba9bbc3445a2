"""Drives a scheduler with a fake model over a workload and checks the invariants after every step."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from scheduler.config import SchedulerConfig
from scheduler.kv_manager import NO_BLOCK
from scheduler.limits import windowed_peak_blocks
from scheduler.output import SchedulerOutput
from scheduler.scheduler import Scheduler
from scheduler.sequence import SequenceStatus
from scheduler.types import FinishReason, SequenceRequest, sample_seq_id
from tests.scheduler.factories import fake_token_for, sample_all

MAX_STEPS = 3_000


@dataclass(frozen=True)
class Arrival:
    step: int
    request: SequenceRequest
    abort_step: int | None  # the whole request (every sample) is aborted at this step
    sample_aborts: tuple[tuple[int, int], ...] = ()  # (step, index): one sample alone is aborted then


class Checker:
    """Drives a scheduler with a fake model and checks the invariants after every step."""

    def __init__(self, config: SchedulerConfig, workload: list[Arrival]) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self.workload = workload
        self.endings: Counter[str] = Counter()
        self.reasons: dict[str, FinishReason] = {}
        # Per sequence: every sample of an n > 1 request is a sequence with its own id.
        self.requests = {
            sample_seq_id(a.request.seq_id, i): dataclasses.replace(
                a.request, seq_id=sample_seq_id(a.request.seq_id, i)
            )
            for a in workload
            for i in range(a.request.n)
        }
        self.tokens: dict[str, list[int]] = {seq_id: [] for seq_id in self.requests}
        # What each KV slot holds, as the fake runner would have written it: (tenant, the token prefix
        # whose last token's K/V is there). A slot is only ever read by a chunk whose own prefix matches.
        self.slots: dict[tuple[int, int], tuple[str, tuple[int, ...]]] = {}
        self.skipped_decodes: set[str] = set()  # running decodes that got no token in the last step

    def run(self) -> None:
        last_arrival = max(a.step for a in self.workload)
        now = 0
        while now <= last_arrival or self.scheduler.has_unfinished():
            assert now < MAX_STEPS, "no progress"
            for a in self.workload:
                if a.step == now:
                    self.scheduler.add(a.request)
                for step, index in a.sample_aborts:
                    if step == now and (
                        finished := self.scheduler.abort(sample_seq_id(a.request.seq_id, index))
                    ):
                        self.end(finished.seq_id, finished.reason)
                if a.abort_step == now:
                    for finished in self.scheduler.abort_request(a.request.seq_id):
                        assert finished.reason is FinishReason.ABORT
                        self.end(finished.seq_id, finished.reason)
            self.step(now)
            now += 1
        self.check_end()

    def step(self, now: int) -> None:
        s = self.scheduler
        was_waiting = {seq.seq_id for seq in s.waiting_sequences()}
        decoding = {q.seq_id for q in s.running_sequences() if q.num_uncomputed_tokens == 1}
        output = s.schedule(float(now))
        self.check_output(output, now, was_waiting)
        self.check_decodes_deferred_one_step_at_most(output, decoding, was_waiting)
        self.check_blocks()
        self.check_kv_reads_and_write(output)
        self.check_long_prefill_cap(output, was_waiting)
        self.check_deadline_heap()
        for finished in output.finished:
            self.end(finished.seq_id, finished.reason)
        for update in s.update(output, sample_all(output)):
            self.tokens[update.seq_id].append(update.token_id)
            if update.finish is not None:
                self.end(update.seq_id, update.finish)
        self.check_blocks()
        assert len(s.running_sequences()) <= self.config.max_num_seqs, "a fork took more seats than exist"

    def end(self, seq_id: str, reason: FinishReason) -> None:
        self.endings[seq_id] += 1
        self.reasons[seq_id] = reason
        assert self.scheduler.sequence(seq_id) is None

    def check_output(self, output: SchedulerOutput, now: int, was_waiting: set[str]) -> None:
        s, cfg = self.scheduler, self.config
        assert output.num_tokens == sum(len(c.token_ids) for c in output.chunks)
        assert output.num_tokens <= cfg.max_num_batched_tokens
        assert len(s.running_sequences()) <= cfg.max_num_seqs
        seen_prefill = False
        num_decodes = 0
        for chunk in output.chunks:
            assert self.endings[chunk.seq_id] == 0, "chunk for an ended sequence"
            seq = s.sequence(chunk.seq_id)
            assert seq is not None and seq.status is SequenceStatus.RUNNING
            request = self.requests[chunk.seq_id]
            assert request.deadline is None or request.deadline >= now, "expired sequence computed"
            end = chunk.start_position + len(chunk.token_ids)
            assert chunk.start_position == seq.num_computed_tokens and len(chunk.token_ids) > 0
            assert chunk.token_ids == tuple(seq.token_ids[chunk.start_position : end])
            assert chunk.sample == (end == seq.num_tokens)
            assert len(chunk.block_table) * cfg.block_size >= end
            assert tuple(chunk.block_table) == tuple(seq.block_table)
            is_decode = len(chunk.token_ids) == 1 and chunk.num_generated > 0 and chunk.sample
            assert not (is_decode and seen_prefill), "decode chunk after a prefill chunk"
            seen_prefill |= not is_decode
            num_decodes += is_decode
        assert output.num_decodes == num_decodes
        adapters = {q.lora for q in s.running_sequences() if q.lora is not None}
        assert len(adapters) <= cfg.max_loras, f"{len(adapters)} LoRA adapters running"
        assert len({c.lora for c in output.chunks if c.lora is not None}) <= cfg.max_loras
        assert all(c.lora == self.requests[c.seq_id].lora for c in output.chunks)
        for finished in output.finished:
            request = self.requests[finished.seq_id]
            if finished.reason is FinishReason.EXPIRED:
                assert request.deadline is not None and request.deadline < now
            if finished.reason is FinishReason.REJECTED:
                assert finished.detail and self.never_fits(request)
        self.check_admission_order(output, was_waiting)

    def check_decodes_deferred_one_step_at_most(
        self, output: SchedulerOutput, decoding: set[str], was_waiting: set[str]
    ) -> None:
        """A running decode sits out a step only while better-class work waits or prefills, and never two
        steps in a row."""
        s = self.scheduler
        scheduled = {c.seq_id for c in output.chunks}
        skipped = [
            seq
            for seq_id in decoding - scheduled - set(output.preempted)
            if (seq := s.sequence(seq_id)) is not None and seq.status is SequenceStatus.RUNNING
        ]
        if skipped:
            assert self.config.defer_worse_decodes, "a decode got no token"
            assert not {q.seq_id for q in skipped} & self.skipped_decodes, (
                "a decode deferred two steps in a row"
            )
            prefilled = [c.seq_id for c in output.chunks if len(c.token_ids) > 1 or c.num_generated == 0]
            better = [q.queue_class for q in map(s.sequence, [*prefilled, *was_waiting]) if q is not None]
            assert better and min(better) < min(q.queue_class for q in skipped), "deferred for nothing better"
        self.skipped_decodes = {q.seq_id for q in skipped}

    def check_admission_order(self, output: SchedulerOutput, was_waiting: set[str]) -> None:
        """Everyone admitted this step is of a class at least as good as everyone left waiting."""
        s = self.scheduler
        admitted = [s.sequence(c.seq_id) for c in output.chunks if c.seq_id in was_waiting]
        # While every LoRA slot is taken, a sequence under an adapter may wait for one behind others.
        slots_full = len({q.lora for q in s.running_sequences() if q.lora}) >= self.config.max_loras
        still_waiting = [
            q
            for q in s.waiting_sequences()
            if q.seq_id not in output.preempted and not (slots_full and q.lora is not None)
        ]
        if admitted and still_waiting:
            assert max(q.queue_class for q in admitted) <= min(q.queue_class for q in still_waiting)

    def check_blocks(self) -> None:
        """Every block's ref count equals its uses by live sequences; free + used == total."""
        s = self.scheduler
        pool = s.kv.pool
        uses = Counter(b for seq in s.running_sequences() for b in seq.block_table if b != NO_BLOCK)
        running = set(s.running_sequences())
        assert all(not seq.block_table for seq in s.live_sequences() if seq not in running)
        assert set(s.waiting_sequences()) <= set(s.live_sequences())
        for block in pool.blocks:
            assert block.ref_count == uses[block.block_id]
        assert pool.num_free == sum(1 for b in pool.blocks if b.ref_count == 0)
        assert pool.num_free + pool.num_used == pool.num_blocks

    def check_kv_reads_and_write(self, output: SchedulerOutput) -> None:
        """Every context slot a chunk attends to holds its own prefix's K/V, written for its own tenant
        (or any tenant when sharing is on); then the chunk's tokens are written. This is what prefix
        caching must never break: hash collisions, missing verification or unsalted keys all show here."""
        bs, share = self.config.block_size, self.config.share_prefix_cache_across_tenants
        pool = self.scheduler.kv.pool
        written: dict[int, str] = {}
        for chunk in output.chunks:
            seq = self.scheduler.sequence(chunk.seq_id)
            assert seq is not None
            # a windowed model's queries see window keys back (one more is kept): those must be there
            seen_from = 0 if self.config.kv_window is None else chunk.start_position - self.config.kv_window
            for pos in range(max(0, seen_from), chunk.start_position):
                assert chunk.block_table[pos // bs] != NO_BLOCK, f"{chunk.seq_id} lost a block it reads"
                tenant, lora, prefix = self.slots.get((chunk.block_table[pos // bs], pos % bs), ("", "", ()))
                assert prefix == tuple(seq.token_ids[: pos + 1]), f"{chunk.seq_id} reads foreign KV at {pos}"
                assert share or tenant == seq.tenant, f"{chunk.seq_id} reads another tenant's KV"
                assert lora == seq.lora, f"{chunk.seq_id} reads KV computed under another LoRA adapter"
            for pos in range(chunk.start_position, chunk.start_position + len(chunk.token_ids)):
                block = chunk.block_table[pos // bs]
                assert block != NO_BLOCK, f"{chunk.seq_id} writes a place given back"
                # A block is written only by its one owner: a shared block is full and computed.
                assert pool.blocks[block].ref_count == 1, f"{chunk.seq_id} writes shared block {block}"
                assert written.setdefault(block, chunk.seq_id) == chunk.seq_id, (
                    f"two chunks write block {block}"
                )
                slot = (block, pos % bs)
                self.slots[slot] = (seq.tenant, seq.lora, tuple(seq.token_ids[: pos + 1]))

    def check_long_prefill_cap(self, output: SchedulerOutput, was_waiting: set[str]) -> None:
        """A running sequence's prefill chunk stays within the cap while a better-class sequence waits."""
        cap = self.config.long_prefill_cap
        s = self.scheduler
        waiting = [seq for seq in map(s.sequence, was_waiting) if seq is not None]
        best_waiting = min((seq.queue_class for seq in waiting), default=None)
        for chunk in output.chunks:
            seq = s.sequence(chunk.seq_id)
            if chunk.seq_id in was_waiting or chunk.seq_id in output.preempted or seq is None:
                continue  # admitted this step (a sequence preempted for priority may be readmitted)
            if len(chunk.token_ids) == 1:
                continue  # a decode
            if cap and best_waiting is not None and best_waiting < seq.queue_class:
                assert len(chunk.token_ids) <= cap, f"{chunk.seq_id}: prefill over the cap while better waits"

    def check_deadline_heap(self) -> None:
        """Ended sequences leave the deadline heap: it tracks exactly the live ones, within 2x entries."""
        s = self.scheduler
        live = [q for q in s.live_sequences() if q.request.deadline is not None]
        deadlines = s._deadlines  # private on purpose: no public accessor exists just for this check
        assert len(deadlines) == len(live) and deadlines.num_entries <= 2 * len(live) + 1

    def never_fits(self, request: SequenceRequest) -> bool:
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        blocks = -(-(total - 1) // self.config.block_size)
        if self.config.kv_window is not None and request.n == 1:
            blocks = min(blocks, windowed_peak_blocks(self.config))
        return total > self.config.max_model_len or blocks > self.config.num_blocks

    def check_end(self) -> None:
        s = self.scheduler
        assert set(self.endings) == set(self.requests)
        assert all(count == 1 for count in self.endings.values()), "a sequence ended twice"
        assert s.kv.pool.num_used == 0 and not s.running_sequences() and not s.waiting_sequences()
        assert s.kv.pool.num_free == s.kv.pool.num_blocks and not s.live_sequences()
        assert all(b.ref_count == 0 for b in s.kv.pool.blocks)
        for seq_id, reason in self.reasons.items():
            request = self.requests[seq_id]
            assert (reason is FinishReason.REJECTED) == self.never_fits(request)
            self.check_tokens(request, reason, self.tokens[seq_id])

    def check_tokens(self, request: SequenceRequest, reason: FinishReason, tokens: list[int]) -> None:
        """Each token sampled once, in order, none lost or repeated across preemptions; the right ending."""
        assert tokens == [fake_token_for(request.seq_id, k) for k in range(len(tokens))]
        assert len(tokens) <= request.sampling.max_tokens
        ends_on_eos = bool(tokens) and not request.sampling.ignore_eos and tokens[-1] in request.eos_token_ids
        if reason is FinishReason.LENGTH:
            assert len(tokens) == request.sampling.max_tokens and not ends_on_eos
        if reason is FinishReason.STOP:
            assert ends_on_eos
        if not request.sampling.ignore_eos and request.eos_token_ids & set(tokens[:-1]):
            raise AssertionError("generation continued past EOS")
