"""LoRA in the scheduler: at most max_loras adapters running, never a job starved for want of a slot, base
work and resident adapters' work admitted past a job that waits for one, the prefix cache salted by adapter
(the random workloads of test_properties.py mix adapters too, checked by tests/scheduler/checker.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.types import Priority
from tests.scheduler.factories import fake_token, make_request, make_scheduler


def _request(seq_id: str, lora: str | None, prompt_len: int = 6, max_tokens: int = 4, **kw):
    return make_request(seq_id, prompt_len, max_tokens, lora=lora, **kw)


def _step(scheduler, now: float) -> tuple[set[str], list[str]]:
    """One step: the adapters in it, and the sequences that ended."""
    output = scheduler.schedule(now)
    ended = [f.seq_id for f in output.finished]
    updates = scheduler.update(output, {c.seq_id: fake_token(c) for c in output.chunks if c.sample})
    ended += [u.seq_id for u in updates if u.finish is not None]
    return {c.lora for c in output.chunks if c.lora is not None}, ended


@settings(max_examples=60, deadline=None)
@given(
    max_loras=st.integers(1, 3),
    seats=st.integers(1, 6),
    stream=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 8), st.integers(1, 6)), min_size=40),
    late=st.integers(0, 5),
)
def test_a_job_whose_adapter_is_not_resident_is_never_starved(max_loras, seats, stream, late):
    """Jobs of resident adapters keep arriving, one a step; a job for another adapter arrives among them.
    Once the jobs that came before it have started, it ends within a bounded number of steps, however
    many come after it."""
    scheduler = make_scheduler(max_loras=max_loras, max_num_seqs=seats, num_blocks=400)
    ended: set[str] = set()
    ahead_started = None  # the step by which every job that arrived before it had started
    for now, (adapter, prompt_len, max_tokens) in enumerate(stream):
        scheduler.add(
            _request(f"s{now}", f"resident{adapter % max_loras}", prompt_len, max_tokens, arrival=now)
        )
        if now == late:
            scheduler.add(_request("late", "new", 4, 3, arrival=now))
        adapters, done = _step(scheduler, float(now))
        assert len(adapters) <= max_loras
        ended.update(done)
        waiting = {s.seq_id for s in scheduler.waiting_sequences()}
        if ahead_started is None and now >= late and not waiting & {f"s{i}" for i in range(late + 1)}:
            ahead_started = now
        if "late" in ended:
            break
    # A sequence takes at most 14 steps once running (a prompt of 8 and 6 tokens, a step each at worst):
    # it waits for one adapter's running sequences to end (none joins them behind it), then runs its own.
    assert "late" in ended and ahead_started is not None
    assert now - ahead_started <= 14 + 8


def test_base_and_resident_work_is_admitted_past_a_job_waiting_for_a_slot():
    scheduler = make_scheduler(max_loras=1, max_num_seqs=4)
    scheduler.add(_request("x0", "x", max_tokens=8, arrival=0.0))
    _step(scheduler, 0.0)
    scheduler.add(_request("y0", "y", arrival=1.0))  # waits: the one slot is x's
    scheduler.add(_request("b0", None, arrival=2.0))
    scheduler.add(_request("x1", "x", arrival=3.0))  # x drains for y: not admitted
    adapters, _ = _step(scheduler, 1.0)
    running = {s.seq_id for s in scheduler.running_sequences()}
    assert running == {"x0", "b0"} and adapters == {"x"}
    waiting = [s.seq_id for s in scheduler.waiting_sequences()]
    assert sorted(waiting) == ["x1", "y0"]
    for now in range(2, 30):  # x0 ends, y0 takes the slot, then x1 waits for y's
        _step(scheduler, float(now))
        if not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished()


def test_a_better_class_job_takes_a_slot_from_worse_class_work():
    scheduler = make_scheduler(max_loras=1, max_num_seqs=4)
    scheduler.add(_request("low", "x", max_tokens=20, priority=Priority.LOW, arrival=0.0))
    _step(scheduler, 0.0)
    scheduler.add(_request("high", "y", priority=Priority.HIGH, arrival=1.0))
    output = scheduler.schedule(1.0)
    assert output.preempted == ("low",)
    assert [c.seq_id for c in output.chunks] == ["high"]


def test_same_prompt_under_two_adapters_shares_no_cached_blocks():
    scheduler = make_scheduler(max_loras=2, block_size=4)
    prompt = list(range(100, 117))

    def run(seq_id: str, lora: str | None) -> int:
        before = scheduler.stats().prefix_cache_hits
        scheduler.add(_request(seq_id, lora, prompt=prompt, max_tokens=2))
        while scheduler.has_unfinished():
            _step(scheduler, 0.0)
        return scheduler.stats().prefix_cache_hits - before

    assert run("base", None) == 0
    assert run("x", "x") == 0  # the base's blocks are no hit for x
    assert run("y", "y") == 0
    assert run("x again", "x") == 16 and run("base again", None) == 16
