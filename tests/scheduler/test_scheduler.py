import pytest

from scheduler.types import FinishReason, Priority
from tests.scheduler.factories import (
    EOS,
    RunLog,
    make_request,
    make_requests,
    make_scheduler,
    run_to_completion,
    sample_all,
    step,
)


def test_requests_run_to_max_tokens_and_free_every_block():
    scheduler = make_scheduler()
    for request in make_requests(3, prompt_len=9, max_tokens=5):
        scheduler.add(request)
    log = run_to_completion(scheduler)
    assert log.endings == {f"r{i}": [FinishReason.LENGTH] for i in range(3)}
    assert all(len(tokens) == 5 for tokens in log.outputs.values())
    assert scheduler.stats().kv_blocks_used == 0 and not scheduler.has_unfinished()


def test_long_prompt_is_chunked_while_others_keep_decoding():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_request("short", prompt_len=4, max_tokens=20))
    log = RunLog()
    step(scheduler, 0, log)  # short: prefill, first token
    scheduler.add(make_request("long", prompt_len=30, max_tokens=2, arrival=1))
    chunks_of_long = []
    for now in range(1, 6):
        output = step(scheduler, now, log)
        assert output.chunks[0].seq_id == "short" and len(output.chunks[0].token_ids) == 1
        assert output.num_tokens <= 8
        chunks_of_long += [c for c in output.chunks if c.seq_id == "long"]
    assert [len(c.token_ids) for c in chunks_of_long[:5]] == [7, 7, 7, 7, 2]
    assert [c.sample for c in chunks_of_long[:5]] == [False, False, False, False, True]
    assert [c.start_position for c in chunks_of_long[:5]] == [0, 7, 14, 21, 28]
    assert len(log.outputs["short"]) == 6  # one token every step, long prompt or not


def test_decode_chunks_come_before_prefill_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add(make_request("a", prompt_len=5))
    log = RunLog()
    step(scheduler, 0, log)
    scheduler.add(make_request("b", prompt_len=5, arrival=1))
    output = step(scheduler, 1, log)
    assert [(c.seq_id, len(c.token_ids)) for c in output.chunks] == [("a", 1), ("b", 5)]


def test_preemption_under_a_tiny_kv_budget_still_completes_with_the_same_tokens():
    requests = make_requests(6, prompt_len=10, max_tokens=12)
    roomy = make_scheduler(num_blocks=64)
    tight = make_scheduler(num_blocks=12)
    for request in requests:
        roomy.add(request)
        tight.add(request)
    roomy_log, tight_log = run_to_completion(roomy), run_to_completion(tight)
    assert tight.stats().preemptions > 0 and roomy.stats().preemptions == 0
    assert tight_log.outputs == roomy_log.outputs
    assert all(e == [FinishReason.LENGTH] for e in tight_log.endings.values())
    assert tight.stats().kv_blocks_used == 0


def test_kv_preemption_picks_the_lowest_class_latest_arrival():
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    scheduler.add(make_request("low_early", prompt_len=8, max_tokens=12, priority=Priority.LOW, arrival=0))
    scheduler.add(make_request("low_late", prompt_len=8, max_tokens=12, priority=Priority.LOW, arrival=1))
    scheduler.add(make_request("high", prompt_len=7, max_tokens=12, priority=Priority.HIGH, arrival=2))
    log = RunLog()
    first = step(scheduler, 0, log)
    assert {c.seq_id for c in first.chunks} == {"high", "low_early", "low_late"}
    preempted = []
    for now in range(1, 6):
        preempted += step(scheduler, now, log).preempted
    assert preempted[0] == "low_late"
    assert scheduler.sequence("low_late").num_preemptions >= 1
    assert scheduler.sequence("high").num_preemptions == 0


def test_preempted_sequence_resumes_before_later_arrivals_of_its_class():
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
    scheduler.add(make_request("a", prompt_len=8, max_tokens=8, arrival=0))
    scheduler.add(make_request("b", prompt_len=8, max_tokens=8, arrival=1))
    log = RunLog()
    now = 0
    while not any("b" in out.preempted for out in log.steps):
        step(scheduler, now, log)
        now += 1
    scheduler.add(make_request("c", prompt_len=4, max_tokens=1, arrival=now))
    admitted = []
    while scheduler.has_unfinished():
        output = step(scheduler, now, log)
        admitted += [c.seq_id for c in output.chunks if c.start_position == 0 or c.seq_id == "b"]
        now += 1
    assert admitted.index("b") < admitted.index("c")


def test_high_arrival_preempts_low_when_running_seats_are_the_bottleneck():
    scheduler = make_scheduler(max_num_seqs=2)
    scheduler.add(make_request("low0", max_tokens=30, priority=Priority.LOW, arrival=0))
    scheduler.add(make_request("low1", max_tokens=30, priority=Priority.LOW, arrival=1))
    log = RunLog()
    step(scheduler, 0, log)
    scheduler.add(make_request("high", max_tokens=3, priority=Priority.HIGH, arrival=2))
    output = step(scheduler, 1, log)
    assert output.preempted == ("low1",)
    assert "high" in {c.seq_id for c in output.chunks}
    assert {s.seq_id for s in scheduler.running_sequences()} == {"low0", "high"}
    log2 = run_to_completion(scheduler, start=2)
    assert set(log2.endings) == {"low0", "low1", "high"}


def test_normal_arrival_does_not_preempt_normal_work():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_request("n0", max_tokens=30))
    log = RunLog()
    step(scheduler, 0, log)
    scheduler.add(make_request("n1", max_tokens=3, arrival=1))
    assert step(scheduler, 1, log).preempted == ()


def test_abort_frees_blocks_at_once_and_ends_once():
    scheduler = make_scheduler()
    scheduler.add(make_request("a", prompt_len=10, max_tokens=10))
    scheduler.add(make_request("waiting", prompt_len=10, max_tokens=10, arrival=1))
    output = scheduler.schedule(0)
    assert scheduler.stats().kv_blocks_used > 0
    finished = scheduler.abort("a")
    assert finished.reason is FinishReason.ABORT
    assert scheduler.abort("a") is None and scheduler.abort("nope") is None
    updates = scheduler.update(output, sample_all(output))  # the in-flight step of "a" is ignored
    assert "a" not in {u.seq_id for u in updates}
    scheduler.abort("waiting")
    assert scheduler.stats().kv_blocks_used == 0 and not scheduler.has_unfinished()


def test_deadline_expires_waiting_and_running_sequences_and_they_never_run_again():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_request("running", max_tokens=50, deadline=3.0))
    scheduler.add(make_request("waiting", max_tokens=5, deadline=2.0, arrival=1))
    log = run_to_completion(scheduler)
    assert log.endings["running"] == [FinishReason.EXPIRED]
    assert log.endings["waiting"] == [FinishReason.EXPIRED]
    expired_at = {f.seq_id: i for i, out in enumerate(log.steps) for f in out.finished}
    assert expired_at == {"waiting": 3, "running": 4}  # steps run at now = 0, 1, 2, ...; deadline < now
    for out in log.steps[expired_at["running"] :]:
        assert not out.chunks
    assert all(c.seq_id != "waiting" for out in log.steps for c in out.chunks)


def test_request_larger_than_the_cache_is_rejected_with_a_reason():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=1000)
    scheduler.add(make_request("big", prompt_len=20, max_tokens=4))
    scheduler.add(make_request("ok", prompt_len=8, max_tokens=4))
    log = run_to_completion(scheduler)
    [rejected] = log.steps[0].finished
    assert rejected.reason is FinishReason.REJECTED
    assert "whole cache has 4" in rejected.detail
    assert log.endings == {"big": [FinishReason.REJECTED], "ok": [FinishReason.LENGTH]}


def test_request_over_max_model_len_is_rejected_with_a_reason():
    scheduler = make_scheduler(max_model_len=16)
    scheduler.add(make_request("long", prompt_len=10, max_tokens=10))
    [rejected] = scheduler.schedule(0).finished
    assert rejected.reason is FinishReason.REJECTED and "max_model_len 16" in rejected.detail
    assert not scheduler.has_unfinished()


def test_prefix_cache_hit_reduces_computed_tokens():
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks of 4
    scheduler = make_scheduler()
    scheduler.add(make_request("first", prompt=prompt, max_tokens=2))
    run_to_completion(scheduler)
    scheduler.add(make_request("second", prompt=prompt + [7], max_tokens=2))
    output = scheduler.schedule(10)
    [chunk] = output.chunks
    assert chunk.start_position == 16 and chunk.token_ids == (prompt[16], prompt[17], 7)
    assert scheduler.stats().prefix_cache_hits == 16


def test_eos_and_stop_tokens_end_a_sequence_unless_eos_is_ignored():
    scheduler = make_scheduler()
    scheduler.add(make_request("eos", ignore_eos=False, max_tokens=10))
    scheduler.add(make_request("ignores", ignore_eos=True, max_tokens=10))
    scheduler.add(make_request("stop", stop_token_ids=(77,), max_tokens=10))
    scheduler.add(make_request("second-eos", ignore_eos=False, eos_token_ids=frozenset({EOS, 55})))
    output = scheduler.schedule(0)
    sampled = {"eos": EOS, "ignores": EOS, "stop": 77, "second-eos": 55}
    updates = {u.seq_id: u for u in scheduler.update(output, sampled)}
    assert updates["eos"].finish is FinishReason.STOP
    assert updates["second-eos"].finish is FinishReason.STOP  # any of the model's EOS ids ends it
    assert updates["ignores"].finish is None
    assert updates["stop"].finish is FinishReason.STOP
    assert [s.seq_id for s in scheduler.running_sequences()] == ["ignores"]


def test_finish_from_outside_ends_a_running_sequence():
    scheduler = make_scheduler()
    scheduler.add(make_request("a", max_tokens=10))
    output = scheduler.schedule(0)
    scheduler.update(output, sample_all(output))
    assert scheduler.finish("a", FinishReason.STOP).reason is FinishReason.STOP
    assert scheduler.stats().kv_blocks_used == 0 and scheduler.schedule(1).empty


def test_duplicate_live_id_is_refused():
    scheduler = make_scheduler()
    scheduler.add(make_request("a"))
    with pytest.raises(ValueError, match="already"):
        scheduler.add(make_request("a"))


def test_missing_sampled_token_is_an_error():
    scheduler = make_scheduler()
    scheduler.add(make_request("a"))
    output = scheduler.schedule(0)
    with pytest.raises(KeyError, match="no sampled token"):
        scheduler.update(output, {})


def test_aging_lets_a_low_request_overtake_a_normal_flood():
    scheduler = make_scheduler(max_num_seqs=1, aging_s=5.0)
    scheduler.add(make_request("low", priority=Priority.LOW, max_tokens=2, arrival=0))
    for i in range(20):
        scheduler.add(make_request(f"n{i}", max_tokens=2, arrival=0))
    log = run_to_completion(scheduler)
    low_done = next(
        i for i, out in enumerate(log.steps) for c in out.chunks if c.seq_id == "low" and c.sample
    )
    assert low_done <= 12  # about 2 steps per normal request ahead of it; promoted twice by t=10


def test_prefill_of_a_better_class_never_crowds_out_decodes_without_deferral():
    scheduler = make_scheduler(max_num_batched_tokens=8, defer_worse_decodes=False)
    scheduler.add(make_request("low", prompt_len=4, max_tokens=20, priority=Priority.LOW))
    log = RunLog()
    step(scheduler, 0, log)
    scheduler.add(make_request("high", prompt_len=40, max_tokens=2, priority=Priority.HIGH, arrival=1))
    for now in range(1, 5):
        output = step(scheduler, now, log)
        assert {c.seq_id: len(c.token_ids) for c in output.chunks} == {"low": 1, "high": 7}


def test_better_class_prefill_defers_worse_decodes_every_other_step_at_most():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_request("low", prompt_len=4, max_tokens=20, priority=Priority.LOW))
    log = RunLog()
    step(scheduler, 0, log)
    scheduler.add(make_request("high", prompt_len=40, max_tokens=2, priority=Priority.HIGH, arrival=1))
    sizes = [{c.seq_id: len(c.token_ids) for c in step(scheduler, now, log).chunks} for now in range(1, 8)]
    assert sizes[:6] == [{"high": 8}, {"low": 1, "high": 7}] * 2 + [{"high": 8}, {"low": 1, "high": 2}]
    assert sizes[6] == {"low": 1, "high": 1}  # high's prompt is done: both decode again
    same_class = make_scheduler(max_num_batched_tokens=8)
    same_class.add(make_request("a", prompt_len=4, max_tokens=20))
    step(same_class, 0, log)
    same_class.add(make_request("b", prompt_len=40, max_tokens=2, arrival=1))
    assert {c.seq_id for c in step(same_class, 1, log).chunks} == {"a", "b"}  # no deferral within a class


def test_waiting_high_is_admitted_before_earlier_normal_and_low():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_request("low", priority=Priority.LOW, arrival=0))
    scheduler.add(make_request("normal", priority=Priority.NORMAL, arrival=1))
    scheduler.add(make_request("high", priority=Priority.HIGH, arrival=2))
    log = run_to_completion(scheduler)
    first_chunks = [
        out.chunks[0].seq_id for out in log.steps if out.chunks and out.chunks[0].start_position == 0
    ]
    assert first_chunks == ["high", "normal", "low"]


def test_stats_report_queues_blocks_and_preemptions():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_request("a", prompt_len=9))
    scheduler.add(make_request("b", priority=Priority.LOW))
    scheduler.schedule(0)
    stats = scheduler.stats()
    assert stats.running == 1 and stats.waiting == {Priority.HIGH: 0, Priority.NORMAL: 0, Priority.LOW: 1}
    assert (stats.kv_blocks_used, stats.kv_blocks_total, stats.preemptions) == (3, 64, 0)


@pytest.mark.parametrize("field", ["num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"])
def test_config_that_can_never_schedule_is_refused(field):
    with pytest.raises(ValueError, match=field):
        make_scheduler(**{field: 0})
