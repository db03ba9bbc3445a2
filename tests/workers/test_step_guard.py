"""Failing steps: the guard finds the sequence at fault by running suspects alone, or gives up on a device
that fails every step, failing no one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from workers.serving.loop.step_guard import StepGuard


def run_steps(guard: StepGuard, live: list[str], breaks, steps: int = 50) -> dict[str, str]:
    """Drive the guard as the worker's loop does (workers/serving/loop.py): a probe is asked for only while
    it isolates, and the step runs it alone or every live sequence; a failure is always reported, a success
    only while the guard is engaged; a sequence held after failing alone leaves the engine
    (`JobLifecycle.hold`), and once only held ones are left they are convicted. `breaks(ran)` says whether
    a step running `ran` raises."""
    live = list(live)
    convicted: dict[str, str] = {}
    for _ in range(steps):
        if guard.gave_up:
            break
        if not live:  # the engine has nothing to run
            if not guard.held():
                break
            convicted.update(guard.convict_when_idle())
            continue
        probe = guard.next_step(live) if guard.isolating else None
        ran = [probe] if probe is not None else list(live)
        if breaks(ran):
            held = guard.failed(ran, "boom")
            if held is not None:
                live.remove(held)
        elif guard.engaged:
            found = guard.succeeded(ran)
            assert not set(found) & set(live)  # only held sequences, already out of the engine, are convicted
            convicted.update(found)
    return convicted


def test_a_poison_sequence_is_found_and_only_it_is_convicted():
    guard = StepGuard()
    convicted = run_steps(guard, ["a", "b", "p", "c"], lambda ran: "p" in ran)
    assert convicted == {"p": "boom"} and not guard.gave_up and not guard.isolating


def test_a_device_that_fails_every_step_makes_the_guard_give_up_without_convicting():
    guard = StepGuard(max_consecutive=3)
    convicted = run_steps(guard, ["a", "b", "c"], lambda ran: True)
    assert convicted == {} and guard.gave_up and guard.consecutive == 3


def test_a_transient_failure_convicts_no_one():
    guard, calls = StepGuard(), iter([True, False, False, False, False, False])
    convicted = run_steps(guard, ["a", "b"], lambda ran: next(calls, False), steps=6)
    assert convicted == {} and not guard.isolating


def test_a_lone_poison_job_is_convicted_when_nothing_else_can_run_and_the_count_stays():
    guard = StepGuard(max_consecutive=3)
    convicted = run_steps(guard, ["p"], lambda ran: True)
    assert convicted == {"p": "boom"} and guard.consecutive == 1 and not guard.gave_up and not guard.held()


@given(
    names=st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=8, unique=True),
    poison=st.sets(st.sampled_from("abcdefgh"), max_size=3),
)
def test_poison_requests_are_convicted_exactly_when_innocents_can_run(names, poison):
    guard = StepGuard(max_consecutive=len(names) + 2)
    convicted = run_steps(guard, names, lambda ran: any(s in poison for s in ran), steps=200)
    assert set(convicted) == set(names) & poison  # innocents never; each poison one once it failed alone
    assert not guard.gave_up
