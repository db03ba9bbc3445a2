"""The scheduler's priority policies: long-prefill cap, KV-block preemption for a better class, the
deadline heap, and the token budget covering the seats."""

from __future__ import annotations

import pytest

from scheduler.types import FinishReason, Priority
from tests.scheduler.factories import RunLog, make_request, make_scheduler, run_to_completion, step


def test_running_low_prefill_is_capped_while_high_waits():
    scheduler = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8, max_num_seqs=2)
    scheduler.add(make_request("low", prompt_len=100, max_tokens=2, priority=Priority.LOW))
    log = RunLog()
    first = step(scheduler, 0, log)
    assert [len(c.token_ids) for c in first.chunks] == [32]  # alone: the whole budget
    scheduler.add(make_request("high", prompt_len=20, max_tokens=2, priority=Priority.HIGH, arrival=1))
    second = step(scheduler, 1, log)
    sizes = {c.seq_id: len(c.token_ids) for c in second.chunks}
    assert sizes == {"low": 8, "high": 20}  # the cap left room: high starts at once


def test_cap_applies_only_while_better_work_waits():
    scheduler = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    scheduler.add(make_request("a", prompt_len=100, max_tokens=2))
    log = RunLog()
    step(scheduler, 0, log)
    scheduler.add(make_request("b", prompt_len=20, max_tokens=2, arrival=1))  # same class: no cap
    sizes = {c.seq_id: len(c.token_ids) for c in step(scheduler, 1, log).chunks}
    assert sizes == {"a": 32}


def test_high_arrival_takes_kv_blocks_from_running_low_work():
    # Two low requests hold 10 of 12 blocks (4 tokens each); seats are free, so only blocks stand in the
    # way of a high request that needs 3.
    scheduler = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(2):
        scheduler.add(make_request(f"low{i}", prompt_len=16, max_tokens=20, priority=Priority.LOW, arrival=i))
    log = RunLog()
    for now in range(5):
        step(scheduler, now, log)
    assert scheduler.stats().kv_blocks_used == 10 and scheduler.stats().preemptions == 0
    scheduler.add(make_request("high", prompt_len=10, max_tokens=4, priority=Priority.HIGH, arrival=5))
    output = step(scheduler, 5, log)
    assert output.preempted == ("low1",)  # the latest low arrival, and only as many as needed
    assert "high" in {c.seq_id for c in output.chunks}
    rest = run_to_completion(scheduler, start=6)
    assert set(rest.endings) == {"low0", "low1", "high"}


def test_no_preemption_when_freeing_worse_work_would_not_make_room():
    scheduler = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add(make_request("high0", prompt_len=36, max_tokens=8, priority=Priority.HIGH))
    scheduler.add(make_request("low", prompt_len=4, max_tokens=4, priority=Priority.LOW, arrival=1))
    log = RunLog()
    step(scheduler, 0, log)
    # 10 blocks in use; freeing the low one's single block cannot make room for a 20-token high prompt.
    scheduler.add(make_request("high1", prompt_len=20, max_tokens=4, priority=Priority.HIGH, arrival=2))
    assert step(scheduler, 1, log).preempted == ()


def test_ended_sequences_leave_the_deadline_heap():
    scheduler = make_scheduler(num_blocks=400, max_num_seqs=8)
    for i in range(40):
        scheduler.add(make_request(f"r{i}", prompt_len=2, max_tokens=1, deadline=1e9))
    run_to_completion(scheduler)
    assert len(scheduler._deadlines) == 0 and scheduler._deadlines.num_entries <= 1


def test_deadlines_still_expire_after_compaction():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_request("late", prompt_len=2, max_tokens=50, deadline=5.0))
    for i in range(6):
        scheduler.add(make_request(f"quick{i}", prompt_len=2, max_tokens=1, deadline=1e9, arrival=-1.0 - i))
    log = run_to_completion(scheduler)
    assert log.endings["late"] == [FinishReason.EXPIRED]


def test_token_budget_must_cover_the_seats():
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be at least max_num_seqs"):
        make_scheduler(max_num_seqs=8, max_num_batched_tokens=7)
    make_scheduler(max_num_seqs=8, max_num_batched_tokens=8)


def test_negative_long_prefill_threshold_is_refused():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        make_scheduler(long_prefill_token_threshold=-1)
