"""Async scheduling (EngineConfig.async_scheduling): step N+1 is scheduled and staged while step N runs on
a worker thread. From the caller's view nothing may change: per request the same tokens, text deltas,
logprobs and finish reason as synchronous steps (each one step() call later)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

import pytest

from gpu.engine import Engine, EngineRequest
from gpu.engine_types import GrammarSpec, StepFailed
from scheduler.types import FinishReason, SamplingParams
from tests.gpu.factories import greedy, make_engine, make_prompts, run_through_failures

# A step of the caller: called after each step() with the engine and the outputs so far (per request).
Hook = Callable[[Engine, dict[str, list[tuple]]], None]


def outputs(
    requests: list[EngineRequest], async_scheduling: bool, hook: Hook | None = None, **config
) -> dict[str, list[tuple]]:
    """Every output per request (request, index) as comparable tuples, the engine run to completion."""
    engine = make_engine(async_scheduling=async_scheduling, **config)
    for request in requests:
        engine.add_request(request)
    outs: dict[str, list[tuple]] = {}

    def record(out) -> None:
        outs.setdefault(f"{out.request_id}#{out.index}", []).append(
            (
                out.new_token_ids,
                out.text_delta,
                out.finish_reason,
                out.started,
                out.prompt_tokens,
                out.completion_tokens,
                out.detail,
                out.logprobs,
            )
        )

    calls = 0
    while engine.has_unfinished():
        calls += 1
        assert calls < 10_000
        for out in engine.step():
            record(out)
        if hook is not None:
            for out in hook(engine, outs) or ():
                record(out)
    engine.close()
    assert engine.stats().kv_blocks_used == 0
    for per_request in outs.values():  # exactly one final output, the last one
        assert [o[2] is not None for o in per_request].count(True) == 1 and per_request[-1][2] is not None
    return outs


def seen(outs: dict[str, list[tuple]]) -> dict[str, tuple]:
    """What a caller gets per request: each token with its text delta and logprobs, then the end. (Outputs
    that carry no token, like a started prefill's first chunk, depend on how the step budget was split.)"""
    view = {}
    for key, per_request in outs.items():
        assert not any(o[3] for o in per_request[1:])  # started once at most, in the first output
        tokens = [(o[0], o[1], o[7]) for o in per_request if o[0]]
        last = per_request[-1]
        view[key] = (
            per_request[0][3],
            tokens,
            "".join(o[1] for o in per_request),
            last[2],
            last[4],
            last[5],
            last[6],
        )
    return view


def assert_same(requests: list[EngineRequest], hook: Hook | None = None, **config) -> dict[str, list[tuple]]:
    sync = outputs(requests, False, hook, **config)
    overlapped = outputs(requests, True, hook, **config)
    assert seen(overlapped) == seen(sync)
    return sync


def mixed_requests(count: int, seed: int = 0) -> list[EngineRequest]:
    """Greedy and seeded random requests of varied lengths; some end on a stop token or a stop string
    taken from what they would generate otherwise, so those stops do happen."""
    prompts = make_prompts(count, 3, 40, seed=seed)
    plain = []
    for i, prompt in enumerate(prompts):
        max_tokens = 1 + (i * 7) % 23
        if i % 3 == 1:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=i)
        else:
            sampling = greedy(max_tokens)
        plain.append(EngineRequest(f"r{i}", prompt, sampling))
    generated = make_engine().generate(plain)
    tokenizer = make_engine().tokenizer
    requests = []
    for i, request in enumerate(plain):
        tokens = generated[request.request_id]
        if i % 3 == 2 and len(tokens) > 3:
            sampling = dataclasses.replace(request.sampling, stop_token_ids=(tokens[2],))
            request = dataclasses.replace(request, sampling=sampling)
        elif i % 3 == 0 and len(tokens) > 4:
            text = tokenizer.decode(tokens)
            request = dataclasses.replace(request, stop=(text[3:5], "never"))
        requests.append(request)
    return requests


def test_same_outputs_with_chunked_prefill_and_stops():
    outs = assert_same(mixed_requests(24), max_num_batched_tokens=32, max_num_seqs=8)
    reasons = {o[-1][2] for o in outs.values()}
    assert FinishReason.LENGTH in reasons and FinishReason.STOP in reasons


def test_same_outputs_under_preemption():
    # Few blocks for many long requests: sequences are preempted (some with a token in flight) and recomputed.
    requests = [EngineRequest(f"p{i}", p, greedy(40)) for i, p in enumerate(make_prompts(12, 20, 40, seed=3))]
    engine = make_engine(num_blocks=24, block_size=8, max_num_seqs=8, async_scheduling=True)
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().preemptions > 0
    assert_same(requests, num_blocks=24, block_size=8, max_num_seqs=8)


def test_same_outputs_with_n_samples_and_prefix_hits():
    prompt = make_prompts(1, 30, 30, seed=5)[0]
    requests = [
        EngineRequest("n", prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=7), n=3),
        EngineRequest("g", prompt, greedy(9), n=2),
        EngineRequest("h", prompt[:20], greedy(5)),
    ]
    assert_same(requests, max_num_batched_tokens=16, max_num_seqs=8)


def test_same_outputs_when_the_caller_aborts_on_what_it_saw():
    requests = mixed_requests(10, seed=2)

    def abort_third_token(engine: Engine, outs: dict[str, list[tuple]]):
        ended = []
        for key, per_request in outs.items():
            seen = sum(len(o[0]) for o in per_request)
            if key.startswith(("r1#", "r4#", "r6#")) and seen >= 3 and per_request[-1][2] is None:
                ended += engine.abort_request(key.split("#")[0])
        return ended

    outs = assert_same(requests, abort_third_token, max_num_seqs=4)
    assert outs["r4#0"][-1][2] is FinishReason.ABORT and sum(len(o[0]) for o in outs["r4#0"]) == 3


def test_an_abort_while_the_first_step_is_in_flight_is_final():
    engine = make_engine(async_scheduling=True, max_num_batched_tokens=16, max_num_seqs=4)
    requests = mixed_requests(6, seed=7)
    for request in requests:
        engine.add_request(request)
    assert engine.step() == []  # the first step is in flight: nothing to report yet
    aborted = [out for r in requests[:3] for out in engine.abort_request(r.request_id)]
    assert [o.finish_reason for o in aborted] == [FinishReason.ABORT] * 3
    later = []
    while engine.has_unfinished():
        later += engine.step()
    engine.close()
    assert not {o.request_id for o in later} & {r.request_id for r in requests[:3]}
    assert {o.request_id for o in later if o.finish_reason} == {r.request_id for r in requests[3:]}
    assert engine.stats().kv_blocks_used == 0


def test_deadlines_and_rejections():
    past = time.monotonic() - 1
    requests = [
        EngineRequest("late", (5, 6, 7), greedy(5), deadline=past),
        EngineRequest("big", tuple(range(3, 300)), greedy(4)),
        *mixed_requests(5, seed=4),
    ]
    outs = assert_same(requests, num_blocks=16, block_size=8)
    assert outs["late#0"][-1][2] is FinishReason.EXPIRED and outs["big#0"][-1][2] is FinishReason.REJECTED


def test_grammar_penalty_and_logprob_rows_force_synchronous_steps():
    spec = GrammarSpec("choice", json.dumps(["alpha", "beta", "gamma delta"]))
    prompts = make_prompts(6, 3, 12, seed=6)
    requests = [
        *mixed_requests(6, seed=6),
        EngineRequest("gram", prompts[0], greedy(20), grammar=spec),
        EngineRequest("pen", prompts[1], greedy(15, repetition_penalty=1.3, frequency_penalty=0.5)),
        EngineRequest("lp", prompts[2], SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2)),
    ]
    outs = assert_same(requests, max_num_batched_tokens=32, max_num_seqs=8)
    assert outs["gram#0"][-1][2] is FinishReason.STOP and all(o[7] for o in outs["lp#0"] if o[0])


def test_the_last_token_in_flight_is_never_fed_back():
    # The cache holds exactly the 40 tokens that are fed (the 41st, last, is only sampled). Were the last
    # token, in flight while the next step is scheduled, fed back, it would need a sixth block: the
    # sequence would preempt itself.
    prompt = make_prompts(1, 9, 9, seed=8)[0]
    request = EngineRequest("m", prompt, greedy(32, ignore_eos=True))
    engine = make_engine(async_scheduling=True, block_size=8, num_blocks=5)
    got = engine.generate([request])
    assert len(got["m"]) == 32 and engine.stats().preemptions == 0
    assert got == make_engine(block_size=8, num_blocks=5).generate([request])


@pytest.mark.parametrize("fail_at", [2, 5])
def test_a_failed_step_rolls_back_and_the_requests_still_finish(fail_at: int):
    requests = [EngineRequest(f"f{i}", p, greedy(12)) for i, p in enumerate(make_prompts(5, 5, 20, seed=9))]
    want = make_engine().generate(requests)
    engine = make_engine(async_scheduling=True)
    calls = 0

    def fail_once(seq_ids: tuple[str, ...]) -> None:
        nonlocal calls
        calls += 1
        if calls == fail_at:
            raise RuntimeError("injected")

    engine.fault_hook = fail_once
    tokens, failures = run_through_failures(engine, requests)
    engine.close()
    [failed] = failures
    assert isinstance(failed, StepFailed) and failed.seq_ids and isinstance(failed.__cause__, RuntimeError)
    assert tokens == want and engine.stats().kv_blocks_used == 0


def test_cuda_step_logic_on_the_worker_thread_matches_hf():
    """The CUDA step (static decode buffers, staging, padding rows; graphs run eagerly on the CPU) driven
    from the async worker thread, placeholders filled after staging from the previous step's sampled
    tensor (as on the device): greedy still equals HF, under preemption too."""
    from tests.gpu.factories import make_model
    from tests.gpu.test_cuda_path import cuda_path_engine
    from tests.gpu.test_gold import run_and_check

    model = make_model()
    engine = cuda_path_engine(
        model, block_size=4, num_blocks=14, max_num_batched_tokens=16, async_scheduling=True
    )
    stats = run_and_check(engine, model, make_prompts(5, 10, 20, seed=5), [20, 25, 15, 22, 18])
    assert stats.preemptions > 0
    engine.close()
