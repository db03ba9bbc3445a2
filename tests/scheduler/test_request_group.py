"""n > 1 samples of one prompt: prefilled once, forked sharing the prompt's KV blocks, ended together."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.sequence import SequenceStatus
from scheduler.types import FinishReason, Priority
from tests.scheduler.checker import Arrival, Checker
from tests.scheduler.factories import make_config, make_request, make_scheduler, run_to_completion, sample_all

SAMPLES = ["r", "r#1", "r#2", "r#3"]


def group_request(n: int = 4, prompt_len: int = 18, max_tokens: int = 3, **kw: object):
    return dataclasses.replace(make_request("r", prompt_len, max_tokens, **kw), n=n)  # type: ignore[arg-type]


def step(scheduler, now: float = 0.0):
    output = scheduler.schedule(now)
    return output, scheduler.update(output, sample_all(output))


@pytest.mark.parametrize("caching", [True, False])
def test_prompt_is_prefilled_once_and_forks_share_its_full_blocks(caching: bool) -> None:
    s = make_scheduler(block_size=4, enable_prefix_caching=caching)
    s.add(group_request(prompt_len=18))
    output, _ = step(s)
    assert [c.seq_id for c in output.chunks] == ["r"] and len(output.chunks[0].token_ids) == 18
    parent = s.sequence("r")
    assert parent is not None and len(parent.block_table) == 5
    for seq_id in SAMPLES[1:]:  # forked on the prefill's update: the 4 full blocks not holding token 17
        child = s.sequence(seq_id)
        assert child is not None and child.status is SequenceStatus.RUNNING
        assert child.block_table == parent.block_table[:4] and child.num_computed_tokens == 16
    assert [s.kv.pool.blocks[b].ref_count for b in parent.block_table] == [4, 4, 4, 4, 1]
    assert s.stats().kv_blocks_used == 5
    output, _ = step(s, 1.0)
    tails = {c.seq_id: (c.start_position, len(c.token_ids)) for c in output.chunks}
    assert tails == {"r": (18, 1), "r#1": (16, 2), "r#2": (16, 2), "r#3": (16, 2)}
    # The prompt's 5 blocks plus one tail block per fork, not 4 x 5.
    assert s.stats().kv_blocks_used == 5 + 3
    assert s.stats().prompt_tokens_computed == 18 + 3 * 2
    log = run_to_completion(s, start=2.0)
    assert log.endings == {k: [FinishReason.LENGTH] for k in SAMPLES}
    assert s.kv.pool.num_free == s.kv.num_blocks


def test_prompt_ending_on_a_block_boundary_leaves_its_last_block_to_each_fork() -> None:
    """16 tokens in blocks of 4: the block of the last prompt token is computed again per fork, never
    written while shared."""
    s = make_scheduler(block_size=4)
    s.add(group_request(n=2, prompt_len=16))
    step(s)
    parent, child = s.sequence("r"), s.sequence("r#1")
    assert parent is not None and child is not None
    assert child.block_table == parent.block_table[:3] and child.num_computed_tokens == 12
    output, _ = step(s, 1.0)
    chunk = next(c for c in output.chunks if c.seq_id == "r#1")
    assert (chunk.start_position, len(chunk.token_ids)) == (12, 4) and chunk.sample
    assert chunk.block_table[3] != parent.block_table[3]


def test_samples_each_sample_their_own_tokens_and_end_on_their_own() -> None:
    s = make_scheduler()
    s.add(group_request(n=3, max_tokens=5))
    log = run_to_completion(s)
    assert set(log.outputs) == {"r", "r#1", "r#2"}
    assert len({tuple(t) for t in log.outputs.values()}) == 3  # the fake model keys tokens by sequence id
    assert all(len(t) == 5 for t in log.outputs.values())


def test_abort_request_before_the_fork_ends_every_sample_once() -> None:
    s = make_scheduler(block_size=4, max_num_batched_tokens=8)
    s.add(group_request(prompt_len=18))
    step(s)  # a chunk of the prompt: nothing forked yet
    assert s.sequence("r#1") is not None and s.sequence("r#1").status is SequenceStatus.AWAITING_FORK
    ended = s.abort_request("r")
    assert [(f.seq_id, f.reason) for f in ended] == [(i, FinishReason.ABORT) for i in SAMPLES]
    assert s.abort_request("r") == [] and not s.has_unfinished()
    assert s.kv.pool.num_used == 0


def test_abort_request_after_the_fork_frees_every_block() -> None:
    s = make_scheduler(block_size=4, enable_prefix_caching=False)
    s.add(group_request(prompt_len=18, max_tokens=20))
    step(s)
    step(s, 1.0)
    assert s.stats().kv_blocks_used == 8
    assert [f.seq_id for f in s.abort_request("r")] == SAMPLES
    assert s.kv.pool.num_used == 0 and not s.has_unfinished()


def test_one_sample_ending_keeps_the_blocks_its_siblings_share() -> None:
    s = make_scheduler(block_size=4, enable_prefix_caching=False)
    s.add(group_request(n=2, prompt_len=18, max_tokens=20))
    step(s)
    step(s, 1.0)
    shared = s.sequence("r").block_table[:4]
    s.abort("r")  # the prefiller goes; its fork still reads the prompt's blocks
    assert all(s.kv.pool.blocks[b].ref_count == 1 for b in shared)
    assert s.sequence("r#1").block_table[:4] == shared
    log = run_to_completion(s, start=2.0)
    assert log.endings == {"r#1": [FinishReason.LENGTH]} and s.kv.pool.num_used == 0


def test_prefiller_aborted_before_the_fork_hands_the_prompt_to_the_next_sample() -> None:
    s = make_scheduler(block_size=4, max_num_batched_tokens=8)
    s.add(group_request(n=3, prompt_len=18))
    step(s)
    assert s.abort("r") is not None
    heir = s.sequence("r#1")
    assert heir is not None and heir.status is SequenceStatus.WAITING
    log = run_to_completion(s, start=1.0)
    assert log.endings == {"r#1": [FinishReason.LENGTH], "r#2": [FinishReason.LENGTH]}


def test_forks_never_take_more_seats_than_exist_and_queued_ones_share_when_admitted() -> None:
    s = make_scheduler(block_size=4, max_num_seqs=2, enable_prefix_caching=False)
    s.add(group_request(prompt_len=18, max_tokens=4))
    step(s)
    assert len(s.running_sequences()) == 2  # the prefiller and one fork; two forks queue
    assert {q.seq_id for q in s.waiting_sequences()} == {"r#2", "r#3"}
    admitted = set()
    now = 1.0
    while s.has_unfinished():
        output, _ = step(s, now)
        assert len(s.running_sequences()) <= 2
        for chunk in output.chunks:
            if chunk.seq_id in ("r#2", "r#3") and chunk.seq_id not in admitted:
                admitted.add(chunk.seq_id)
                # Admitted beside a running sibling: its prompt blocks are shared, only the tail computed.
                assert chunk.start_position == 16
        now += 1
    assert admitted == {"r#2", "r#3"} and s.kv.pool.num_used == 0


def test_rejected_request_rejects_every_sample() -> None:
    s = make_scheduler(block_size=4, num_blocks=2)
    s.add(group_request(n=3, prompt_len=18))
    output = s.schedule(0.0)
    assert [(f.seq_id, f.reason) for f in output.finished] == [
        (i, FinishReason.REJECTED) for i in SAMPLES[:3]
    ]
    assert not s.has_unfinished()


def test_n_below_one_is_rejected() -> None:
    s = make_scheduler()
    s.add(group_request(n=0))
    [finished] = s.schedule(0.0).finished
    assert finished.reason is FinishReason.REJECTED and "n must be" in finished.detail


def test_a_sample_id_already_live_is_refused() -> None:
    s = make_scheduler()
    s.add(group_request(n=2))
    with pytest.raises(ValueError):
        s.add(make_request("r#1"))
    s.add(make_request("x#2"))
    with pytest.raises(ValueError):
        s.add(dataclasses.replace(make_request("x"), n=3))


def test_deadline_expires_every_sample() -> None:
    s = make_scheduler(block_size=4)
    s.add(group_request(prompt_len=18, max_tokens=50, deadline=3.0))
    step(s)
    output = s.schedule(5.0)
    assert sorted(f.seq_id for f in output.finished) == sorted(SAMPLES)
    assert {f.reason for f in output.finished} == {FinishReason.EXPIRED}
    assert s.kv.pool.num_used == 0 and not s.has_unfinished()


def test_only_runs_every_running_sample_of_the_request() -> None:
    s = make_scheduler(block_size=4)
    s.add(group_request(n=3, prompt_len=18, max_tokens=10))
    s.add(make_request("other", 6, 10))
    step(s)
    output = s.schedule(1.0, only="r")
    assert sorted(c.seq_id for c in output.chunks) == ["r", "r#1", "r#2"]
    s.update(output, sample_all(output))
    assert sorted(s.running_request_ids()) == ["other", "r"]  # each request once, however many samples


def test_samples_preempted_and_recomputed_keep_every_invariant() -> None:
    """A cache too small for all samples at once: samples are preempted (their shared blocks kept while a
    sibling holds them), recomputed, and every invariant of the checker holds throughout."""
    requests = [
        dataclasses.replace(make_request("g", 14, 12, priority=Priority.LOW), n=4),
        dataclasses.replace(make_request("h", 9, 8, arrival=2.0), n=3),
        make_request("solo", 11, 6, arrival=3.0, priority=Priority.HIGH),
    ]
    workload = [Arrival(int(r.arrival), r, None) for r in requests]
    config = make_config(num_blocks=14, block_size=4, max_num_seqs=5, max_num_batched_tokens=16)
    checker = Checker(config, workload)
    checker.run()
    assert checker.scheduler.stats().preemptions > 0
