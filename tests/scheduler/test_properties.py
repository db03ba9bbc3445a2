"""Property tests: random arrivals, lengths, priorities, tenants, aborts and deadlines over many steps."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import Counter
from unittest import mock

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from scheduler import kv_manager
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from scheduler.types import Priority, SamplingParams, SequenceRequest
from tests.scheduler.checker import Arrival, Checker
from tests.scheduler.factories import fake_token, fake_token_for, make_config

PREFIXES = [list(range(1, 40)), list(range(200, 240))]  # shared prompt starts, to exercise the prefix cache


@st.composite
def configs(draw) -> SchedulerConfig:
    max_num_seqs = draw(st.integers(1, 6))
    return make_config(
        num_blocks=draw(st.integers(4, 40)),
        block_size=draw(st.sampled_from([1, 2, 4, 8])),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 40)),
        max_model_len=draw(st.sampled_from([32, 64])),
        enable_prefix_caching=draw(st.booleans()),
        share_prefix_cache_across_tenants=draw(st.booleans()),
        aging_s=draw(st.sampled_from([math.inf, 3.0, 10.0])),
        long_prefill_token_threshold=draw(st.sampled_from([None, 0, 1, 3, 8])),
        kv_window=draw(st.sampled_from([None, None, 1, 3, 8])),  # a model windowed on every layer
        max_loras=draw(st.sampled_from([1, 2, 4])),
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
            lora=draw(st.sampled_from([None, None, "x", "y", "z"])),  # the same prompts under several
            arrival=float(step),
            deadline=deadline,
            # Often tokens the fake model will produce at some step, so EOS endings happen.
            eos_token_ids=draw(
                st.frozensets(st.integers(0, 11).map(lambda k, i=i: fake_token_for(f"s{i}", k)), max_size=3)
            ),
        )
        # Often several samples of one prompt, forking from its first; now and then one sample aborted
        # alone (before the fork too: another sample then prefills).
        n = draw(st.sampled_from([1, 1, 2, 3, 4]))
        request = dataclasses.replace(request, n=n)
        abort_step = draw(st.one_of(st.none(), st.integers(step, step + 30)))
        sample_aborts = draw(
            st.lists(
                st.tuples(st.integers(step, step + 20), st.integers(0, n - 1)), max_size=2 if n > 1 else 0
            )
        )
        out.append(Arrival(step, request, abort_step, tuple(sample_aborts)))
    return out


PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(configs(), arrivals())
def test_random_workloads_keep_every_invariant(config: SchedulerConfig, workload: list[Arrival]) -> None:
    Checker(config, workload).run()


def weak_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """Four bits of SHA-256: prefix keys collide all the time, so only verification keeps KV right."""
    return bytes([hashlib.sha256(parent + repr(tokens).encode()).digest()[0] & 0x0F])


@PROPERTY_SETTINGS
@given(configs(), arrivals())
def test_colliding_prefix_keys_never_share_wrong_kv(config: SchedulerConfig, workload: list[Arrival]) -> None:
    with mock.patch.object(kv_manager, "chain_key", weak_key):
        Checker(config, workload).run()


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 4),
    st.sampled_from([2, 4]),
    st.lists(st.tuples(st.integers(4, 24), st.integers(8, 30)), min_size=1, max_size=4),
    st.integers(1, 20),
    st.integers(0, 8),
)
def test_better_class_gets_blocks_held_by_worse_work(seats, block_size, lows, high_prompt, after) -> None:
    """Worse-class work holds the KV cache; a better-class arrival that would fit once that work is freed
    starts within two steps, whatever else runs (the high class never waits for low work to finish)."""
    low_blocks = sum(-(-(p + m) // block_size) for p, m in lows)
    num_blocks = max(low_blocks, -(-(high_prompt + 4) // block_size)) + 1
    scheduler = Scheduler(
        make_config(num_blocks=num_blocks, block_size=block_size, max_num_seqs=seats + 1,
                    max_num_batched_tokens=64, enable_prefix_caching=False)
    )  # fmt: skip
    for i, (prompt_len, max_tokens) in enumerate(lows):
        scheduler.add(_request(f"low{i}", prompt_len, max_tokens, Priority.LOW, 0.0, 1000 + 100 * i))
    for now in range(after):
        out = scheduler.schedule(float(now))
        scheduler.update(out, {c.seq_id: fake_token(c) for c in out.chunks if c.sample})
    scheduler.add(_request("high", high_prompt, 4, Priority.HIGH, float(after), 50))
    started = None
    for now in range(after, after + 2):
        out = scheduler.schedule(float(now))
        if any(c.seq_id == "high" for c in out.chunks):
            started = now
            break
        scheduler.update(out, {c.seq_id: fake_token(c) for c in out.chunks if c.sample})
    assert started is not None, "a high request waited while low work held the blocks it needed"


def _request(
    seq_id: str, prompt_len: int, max_tokens: int, priority: Priority, arrival: float, base: int
) -> SequenceRequest:
    return SequenceRequest(
        seq_id=seq_id,
        prompt_token_ids=tuple(range(base, base + prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        priority=priority,
        arrival=arrival,
    )


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.tuples(st.integers(1, 16), st.integers(1, 8)), min_size=20, max_size=40),
    st.lists(st.tuples(st.integers(1, 16), st.integers(1, 8)), min_size=3, max_size=6),
)
# b's last request decodes alone for 8 steps while a admits 7- and 16-token prompts beside it.
@example(
    3, [(1, 1)] * 13 + [(2, 1), (7, 1), (16, 1), (7, 1), (16, 1), (7, 1), (16, 1)], [(1, 1), (2, 1), (1, 8)]
)
def test_flooding_tenant_cannot_starve_another_in_the_same_class(max_num_seqs, flood, handful) -> None:
    """While tenant b has work waiting, it is served about as many tokens as the flooding tenant a.

    Only steps that start with some of b's work waiting count: once all of b runs, b may be unable to use
    its share (one long decode takes a token a step while a's new prompts take many), which is no
    starvation.
    """
    scheduler = Scheduler(make_config(num_blocks=200, max_num_seqs=max_num_seqs, max_num_batched_tokens=24))
    for i, (prompt_len, max_tokens) in enumerate(flood):
        scheduler.add(_fair_request(f"a{i}", "a", prompt_len, max_tokens, arrival=0.0, index=i))
    for i, (prompt_len, max_tokens) in enumerate(handful):  # arrives after the flood: FIFO would starve it
        scheduler.add(_fair_request(f"b{i}", "b", prompt_len, max_tokens, arrival=1.0, index=100 + i))
    served: Counter[str] = Counter()
    now = 0
    while any(_tenant_live(scheduler, "b")):
        b_waits = any(seq.tenant == "b" for seq in scheduler.waiting_sequences())
        output = scheduler.schedule(float(now))
        for chunk in output.chunks if b_waits else ():
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
