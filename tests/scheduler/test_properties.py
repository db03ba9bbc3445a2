"""Property tests: random arrivals, lengths, priorities, tenants, aborts and deadlines over many steps."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.config import SchedulerConfig
from scheduler.output import SchedulerOutput
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.types import FinishReason, Priority, SamplingParams, SequenceRequest
from tests.scheduler.factories import fake_token, fake_token_for, make_config, sample_all

MAX_STEPS = 3_000
PREFIXES = [list(range(1, 40)), list(range(200, 240))]  # shared prompt starts, to exercise the prefix cache


@dataclass(frozen=True)
class Arrival:
    step: int
    request: SequenceRequest
    abort_step: int | None


@st.composite
def configs(draw) -> SchedulerConfig:
    return make_config(
        num_blocks=draw(st.integers(4, 40)),
        block_size=draw(st.sampled_from([1, 2, 4, 8])),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 40)),
        max_model_len=draw(st.sampled_from([32, 64])),
        enable_prefix_caching=draw(st.booleans()),
        aging_s=draw(st.sampled_from([math.inf, 3.0, 10.0])),
    )


@st.composite
def arrivals(draw, n_max: int = 14) -> list[Arrival]:
    out = []
    for i in range(draw(st.integers(1, n_max))):
        step = draw(st.integers(0, 25))
        prompt_len = draw(st.integers(1, 30))
        if draw(st.booleans()):
            prefix = draw(st.sampled_from(PREFIXES))
            prompt = prefix[: min(prompt_len, len(prefix))]
        else:
            prompt = [500 + 37 * i + j for j in range(prompt_len)]
        deadline = draw(st.one_of(st.none(), st.integers(1, 40).map(lambda d, s=step: float(s + d))))
        request = SequenceRequest(
            seq_id=f"s{i}",
            prompt_token_ids=tuple(prompt),
            sampling=SamplingParams(max_tokens=draw(st.integers(1, 12)), ignore_eos=draw(st.booleans())),
            priority=draw(st.sampled_from(list(Priority))),
            tenant=draw(st.sampled_from(["a", "b", "c"])),
            arrival=float(step),
            deadline=deadline,
            # Often tokens the fake model will produce at some step, so EOS endings happen.
            eos_token_ids=draw(
                st.frozensets(st.integers(0, 11).map(lambda k, i=i: fake_token_for(f"s{i}", k)), max_size=3)
            ),
        )
        abort_step = draw(st.one_of(st.none(), st.integers(step, step + 30)))
        out.append(Arrival(step, request, abort_step))
    return out


class Checker:
    """Drives a scheduler with a fake model and checks the invariants after every step."""

    def __init__(self, config: SchedulerConfig, workload: list[Arrival]) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self.workload = workload
        self.endings: Counter[str] = Counter()
        self.reasons: dict[str, FinishReason] = {}
        self.requests = {a.request.seq_id: a.request for a in workload}
        self.tokens: dict[str, list[int]] = {seq_id: [] for seq_id in self.requests}

    def run(self) -> None:
        last_arrival = max(a.step for a in self.workload)
        now = 0
        while now <= last_arrival or self.scheduler.has_unfinished():
            assert now < MAX_STEPS, "no progress"
            for a in self.workload:
                if a.step == now:
                    self.scheduler.add(a.request)
                if a.abort_step == now and (finished := self.scheduler.abort(a.request.seq_id)):
                    self.end(finished.seq_id, finished.reason)
            self.step(now)
            now += 1
        self.check_end()

    def step(self, now: int) -> None:
        s = self.scheduler
        was_waiting = {seq.seq_id for seq in s.waiting_sequences()}
        output = s.schedule(float(now))
        self.check_output(output, now, was_waiting)
        self.check_blocks()
        for finished in output.finished:
            self.end(finished.seq_id, finished.reason)
        for update in s.update(output, sample_all(output)):
            self.tokens[update.seq_id].append(update.token_id)
            if update.finish is not None:
                self.end(update.seq_id, update.finish)
        self.check_blocks()

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
            assert list(chunk.block_table) == seq.block_table
            is_decode = len(chunk.token_ids) == 1 and chunk.num_generated > 0 and chunk.sample
            assert not (is_decode and seen_prefill), "decode chunk after a prefill chunk"
            seen_prefill |= not is_decode
        for finished in output.finished:
            request = self.requests[finished.seq_id]
            if finished.reason is FinishReason.EXPIRED:
                assert request.deadline is not None and request.deadline < now
            if finished.reason is FinishReason.REJECTED:
                assert finished.detail and self.never_fits(request)
        self.check_admission_order(output, was_waiting)

    def check_admission_order(self, output: SchedulerOutput, was_waiting: set[str]) -> None:
        """Everyone admitted this step is of a class at least as good as everyone left waiting."""
        s = self.scheduler
        admitted = [s.sequence(c.seq_id) for c in output.chunks if c.seq_id in was_waiting]
        still_waiting = [q for q in s.waiting_sequences() if q.seq_id not in output.preempted]
        if admitted and still_waiting:
            assert max(q.queue_class for q in admitted) <= min(q.queue_class for q in still_waiting)

    def check_blocks(self) -> None:
        """Every block's ref count equals its uses by live sequences; free + used == total."""
        s = self.scheduler
        pool = s.kv.pool
        uses = Counter(b for seq in s.running_sequences() for b in seq.block_table)
        assert all(not seq.block_table for seq in s.waiting_sequences())
        for block in pool.blocks:
            assert block.ref_count == uses[block.block_id]
        assert pool.num_free == sum(1 for b in pool.blocks if b.ref_count == 0)
        assert pool.num_free + pool.num_used == pool.num_blocks

    def never_fits(self, request: SequenceRequest) -> bool:
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        blocks = -(-(total - 1) // self.config.block_size)
        return total > self.config.max_model_len or blocks > self.config.num_blocks

    def check_end(self) -> None:
        s = self.scheduler
        assert set(self.endings) == set(self.requests)
        assert all(count == 1 for count in self.endings.values()), "a sequence ended twice"
        assert s.kv.pool.num_used == 0 and not s.running_sequences() and not s.waiting_sequences()
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


PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(configs(), arrivals())
def test_random_workloads_keep_every_invariant(config: SchedulerConfig, workload: list[Arrival]) -> None:
    Checker(config, workload).run()


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.tuples(st.integers(1, 16), st.integers(1, 8)), min_size=20, max_size=40),
    st.lists(st.tuples(st.integers(1, 16), st.integers(1, 8)), min_size=3, max_size=6),
)
def test_flooding_tenant_cannot_starve_another_in_the_same_class(max_num_seqs, flood, handful) -> None:
    """While tenant b still has work, it is served about as many tokens as the flooding tenant a."""
    scheduler = Scheduler(make_config(num_blocks=200, max_num_seqs=max_num_seqs, max_num_batched_tokens=24))
    for i, (prompt_len, max_tokens) in enumerate(flood):
        scheduler.add(_fair_request(f"a{i}", "a", prompt_len, max_tokens, arrival=0.0, index=i))
    for i, (prompt_len, max_tokens) in enumerate(handful):  # arrives after the flood: FIFO would starve it
        scheduler.add(_fair_request(f"b{i}", "b", prompt_len, max_tokens, arrival=1.0, index=100 + i))
    served: Counter[str] = Counter()
    now = 0
    while any(_tenant_live(scheduler, "b")):
        output = scheduler.schedule(float(now))
        for chunk in output.chunks:
            served[chunk.seq_id[0]] += len(chunk.token_ids)
        scheduler.update(output, {c.seq_id: fake_token(c) for c in output.chunks if c.sample})
        now += 1
    # The share can lag by what one admission commits: at most a seat's worth of one request per seat.
    tolerance = max_num_seqs * (16 + 8)
    assert served["b"] >= served["a"] - tolerance
    assert served["a"] >= served["b"] - tolerance or not any(_tenant_live(scheduler, "a"))


def _fair_request(
    seq_id: str, tenant: str, prompt_len: int, max_tokens: int, arrival: float, index: int
) -> SequenceRequest:
    base = 1000 + 100 * index  # disjoint prompts: no prefix hits
    return SequenceRequest(
        seq_id=seq_id,
        prompt_token_ids=tuple(range(base, base + prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        tenant=tenant,
        arrival=arrival,
    )


def _tenant_live(scheduler: Scheduler, tenant: str) -> list[Sequence]:
    return [s for s in scheduler.running_sequences() + scheduler.waiting_sequences() if s.tenant == tenant]


def test_progress_on_a_saturated_cache_with_all_classes() -> None:
    """Many requests, tiny cache, every class: the simulation terminates and everything ends once."""
    workload = [
        Arrival(
            i % 7,
            SequenceRequest(
                seq_id=f"s{i}",
                prompt_token_ids=tuple(PREFIXES[i % 2][: 5 + i % 20]),
                sampling=SamplingParams(max_tokens=1 + i % 9, ignore_eos=True),
                priority=Priority(i % 3),
                tenant="ab"[i % 2],
                arrival=float(i % 7),
            ),
            None,
        )
        for i in range(60)
    ]
    Checker(make_config(num_blocks=12, max_num_seqs=5, max_num_batched_tokens=10), workload).run()
