"""The engine in a process of its own: the same outputs as in-process, a step launched ahead that aborts,
refusals and failed steps still reach the caller as Engine's do, and the child never outlives the worker."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial

import pytest

from gpu.engine import EngineRequest
from gpu.engine_process import EngineProcess, EngineProcessDied
from gpu.engine_types import ResumeRefused, StepFailed
from scheduler.types import FinishReason
from tests.gpu.factories import greedy, make_engine, make_prompts, run_to_end

CONFIG = dict(max_num_batched_tokens=64, max_num_seqs=8)


def _engine_failing_on(request_id: str, from_its_step: int = 1):
    """In the child: an engine whose steps raise while they run `request_id` (a poison request), from its
    `from_its_step`-th step on."""
    engine = make_engine(**CONFIG)
    steps = []

    def hook(ids: tuple[str, ...]) -> None:
        if request_id in ids:
            steps.append(ids)
            if len(steps) >= from_its_step:
                raise RuntimeError(f"poison {request_id}")

    engine.fault_hook = hook
    return engine


def _good_and_bad(engine: EngineProcess, max_tokens: int) -> None:
    prompts = make_prompts(2, 4, 6)
    engine.add_request(EngineRequest("good", prompts[0], greedy(max_tokens, ignore_eos=True)))
    engine.add_request(EngineRequest("bad", prompts[1], greedy(max_tokens, ignore_eos=True)))


@pytest.fixture
def process():
    engine = EngineProcess(partial(make_engine, **CONFIG))
    yield engine
    engine.close()


def requests(n: int = 12) -> list[EngineRequest]:
    prompts = make_prompts(n, 3, 40, seed=5)
    return [EngineRequest(f"r{i}", p, greedy(1 + (7 * i) % 13)) for i, p in enumerate(prompts)]


def summary(outs: dict[str, list]) -> dict[str, tuple]:
    return {
        rid: (
            tuple(t for o in os_ for t in o.new_token_ids),
            "".join(o.text_delta for o in os_),
            [o.finish_reason for o in os_ if o.finish_reason is not None],
        )
        for rid, os_ in outs.items()
    }


def test_outputs_equal_the_in_process_engine(process):
    batch = requests()
    assert summary(run_to_end(process, batch)) == summary(run_to_end(make_engine(**CONFIG), batch))
    assert process.stats().steps > 0 and process.tokenizer.decode(process.tokenizer.encode("AB")) == "AB"
    assert process.scheduler.config.max_num_seqs == 8


def test_an_abort_while_a_step_runs_ahead_ends_the_request_once(process):
    batch = [
        EngineRequest(f"a{i}", p, greedy(30, ignore_eos=True)) for i, p in enumerate(make_prompts(4, 5, 9))
    ]
    for r in batch:
        process.add_request(r)
    first = process.step()  # returns step 1 and launches step 2
    assert {o.request_id for o in first} == {r.request_id for r in batch}
    aborted = process.abort_request("a1")
    assert [(o.request_id, o.finish_reason) for o in aborted] == [("a1", FinishReason.ABORT)]
    outs: dict[str, list] = {}
    while process.has_unfinished():
        for out in process.step():
            outs.setdefault(out.request_id, []).append(out)
    assert not any(o.finish_reason for o in outs.get("a1", []))  # step 2's token, then nothing
    assert len(outs.get("a1", [])) <= 1
    for rid in ("a0", "a2", "a3"):
        assert [o.finish_reason for o in outs[rid] if o.finish_reason] == [FinishReason.LENGTH]
        assert sum(len(o.new_token_ids) for o in first + outs[rid] if o.request_id == rid) == 30


def test_a_request_the_child_refuses_ends_rejected_with_why(process):
    prompt = make_prompts(1, 4, 4)[0]
    process.add_request(EngineRequest("twice", prompt, greedy(40, ignore_eos=True)))
    process.step()
    process.add_request(EngineRequest("twice", prompt, greedy(2)))
    outs = process.step() + process.step()  # it goes with the step launched next: its news one step later
    refused = [o for o in outs if o.finish_reason is FinishReason.REJECTED]
    assert len(refused) == 1 and "already in the engine" in refused[0].detail
    assert process.abort_request("twice")[0].finish_reason is FinishReason.ABORT


def test_a_resume_is_refused_at_add_and_one_that_passes_resumes_in_the_child(process):
    prompt = make_prompts(1, 6, 6, seed=3)[0]
    whole = run_to_end(make_engine(**CONFIG), [EngineRequest("w", prompt, greedy(12, ignore_eos=True))])
    tokens = tuple(t for o in whole["w"] for t in o.new_token_ids)
    with pytest.raises(ResumeRefused, match="stop token"):  # raised here, in the worker's process
        process.add_request(EngineRequest("r", prompt, greedy(12), resume=((5, 2, 9),)))
    request = EngineRequest("w", prompt, greedy(12, ignore_eos=True), resume=(tokens[:5],))
    resumed = run_to_end(process, [request])
    assert summary(resumed) == summary(whole)
    assert [o.resumed for o in resumed["w"] if o.new_token_ids][:2] == [True, False]


def test_a_failed_step_raises_step_failed_and_a_probe_runs_one_request_alone():
    engine = EngineProcess(partial(_engine_failing_on, "bad"))
    try:
        _good_and_bad(engine, 5)
        with pytest.raises(StepFailed) as failed:
            engine.step()
        assert set(failed.value.seq_ids) == {"good", "bad"} and "poison bad" in str(failed.value)
        assert sorted(engine.running_ids()) == ["bad", "good"]
        assert {o.request_id for o in engine.step(only="good")} == {"good"}
        with pytest.raises(StepFailed):
            engine.step(only="bad")
        engine.abort_request("bad")
        tokens = []
        while engine.has_unfinished():
            tokens += [t for o in engine.step() for t in o.new_token_ids]
        assert len(tokens) == 4  # good's other four
    finally:
        engine.close()


def test_an_abort_reads_a_failed_step_launched_ahead_first_and_step_raises_it_next():
    engine = EngineProcess(partial(_engine_failing_on, "bad", from_its_step=2))
    try:
        _good_and_bad(engine, 20)
        assert {o.request_id for o in engine.step()} == {"good", "bad"}  # step 2 now fails in the child
        aborted = engine.abort_request("good")
        assert [(o.request_id, o.finish_reason) for o in aborted] == [("good", FinishReason.ABORT)]
        with pytest.raises(StepFailed) as failed:
            engine.step()
        assert set(failed.value.seq_ids) == {"good", "bad"}
        with pytest.raises(StepFailed):  # replies still pair with their messages
            engine.step(only="bad")
        assert [o.finish_reason for o in engine.abort_request("bad")] == [FinishReason.ABORT]
        assert not engine.has_unfinished()
    finally:
        engine.close()


def test_a_refusal_that_rides_on_an_abort_comes_out_of_the_next_step(process):
    prompts = make_prompts(2, 4, 6)
    process.add_request(EngineRequest("long", prompts[0], greedy(40, ignore_eos=True)))
    process.step()
    process.add_request(EngineRequest("long", prompts[1], greedy(2)))  # refused: the id is live
    assert process.abort_request("never-added") == []
    refused = [o for o in process.step() if o.finish_reason is FinishReason.REJECTED]
    assert len(refused) == 1 and "already in the engine" in refused[0].detail


def test_a_dead_engine_process_is_reported_and_holds_nothing(process):
    process.add_request(EngineRequest("x", make_prompts(1, 4, 4)[0], greedy(50, ignore_eos=True)))
    process.step()
    os.kill(process._process.pid, signal.SIGKILL)
    process._process.join(10)
    assert process.abort_request("x") == []  # never raises: the next step says it
    assert process.has_unfinished()
    with pytest.raises(EngineProcessDied, match="code -9"):
        process.step()
    assert process.abort_request("x") == []


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_worker_that_is_pid_1_keeps_its_engine():
    """In a container the worker is often pid 1: its engine's process must not take that for an orphan."""
    code = (
        "from functools import partial; from gpu.engine_process import EngineProcess; "
        "from gpu.engine import EngineRequest; from tests.gpu.factories import make_engine, greedy; "
        "import os; assert os.getpid() == 1; e = EngineProcess(partial(make_engine, num_blocks=16)); "
        "e.add_request(EngineRequest('a', (5, 6, 7), greedy(2))); print(len(e.step())); e.close()"
    )
    # A new pid namespace needs root (CI runs as root) or, without it, a user namespace of one's own.
    for namespaces in (["--pid"], ["--user", "--map-root-user", "--pid"]):
        done = subprocess.run(["unshare", *namespaces, "--fork", sys.executable, "-c", code],
                              capture_output=True, text=True, cwd=os.getcwd(), timeout=600)  # fmt: skip
        if not (done.returncode != 0 and "Operation not permitted" in done.stderr):
            break
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr[-2000:]


def test_the_engine_process_does_not_outlive_its_worker():
    code = (
        "import sys; from functools import partial; from gpu.engine_process import EngineProcess; "
        "from tests.gpu.factories import make_engine; "
        "e = EngineProcess(partial(make_engine, num_blocks=16)); print(e._process.pid, flush=True); "
        "sys.stdin.read()"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=os.getcwd())  # fmt: skip
    try:
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # alive
        parent.kill()  # SIGKILL: no atexit, no cleanup of its own
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        raise AssertionError(f"engine process {child} outlived its parent")
    finally:
        parent.kill()


def test_requests_on_their_way_to_the_child_count_as_waiting(process):
    """The worker caps the jobs it holds by the engine's waiting count: a request queued here, or carried
    by a step launched ahead whose reply has not come yet, is held all the same (the last reply's stats
    cannot count it)."""
    first, later = requests(12)[:8], requests(12)[8:]
    for request in first:
        process.add_request(request)
    assert sum(process.stats().waiting.values()) == 8  # queued here: no message sent yet
    process.step()  # its reply's state counts them; the next step is launched, carrying nothing
    for request in later:
        process.add_request(request)
    stats = process.stats()
    held = stats.running + sum(stats.waiting.values())
    assert held >= 4 + 8 - len([r for r in first if r.sampling.max_tokens == 1])  # none lost from the count
    process.step()  # the 4 ride this message (after the step launched ahead): not answered yet
    stats = process.stats()
    assert sum(stats.waiting.values()) >= 4
    while process.has_unfinished():
        process.step()
    assert sum(process.stats().waiting.values()) == 0


def test_load_lora_round_trips_and_adapter_requests_equal_the_in_process_engine(process, tmp_path):
    """An adapter loads in the child (a bad one raises LoraError here with the child's message, and the
    engine goes on); requests under it, and under a bad one, end as in process."""
    from gpu.engine_types import LoraRequest
    from gpu.lora import LoraError
    from tests.gpu.factories import make_model
    from tests.gpu.lora_factories import make_adapter

    good, _ = make_adapter(make_model(), tmp_path, "good", seed=1)
    missing = LoraRequest("missing", str(tmp_path / "missing"))
    process.add_request(requests(1)[0])  # a step runs ahead while the adapter loads
    process.step()
    process.load_lora(good)
    with pytest.raises(LoraError, match=r"^adapter 'missing' \(.*\): no such directory$"):
        process.load_lora(missing)
    prompts = make_prompts(3, 3, 20, seed=8)
    batch = [EngineRequest(f"l{i}", p, greedy(6), lora=lora) for i, (p, lora) in
             enumerate(zip(prompts, [good, missing, None], strict=True))]  # fmt: skip
    got = summary(run_to_end(process, batch))
    assert got == summary(run_to_end(make_engine(**CONFIG), batch))
    assert got["l1"][2] == [FinishReason.REJECTED]
