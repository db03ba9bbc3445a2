"""Engine behaviour: outputs and text deltas, stop strings, EOS, abort, deadlines, rejection, stats."""

from __future__ import annotations

import time

from gpu.engine import EngineRequest
from scheduler.types import FinishReason, SamplingParams
from tests.gpu.factories import greedy, make_engine, make_prompts, run_to_end


def test_outputs_carry_started_deltas_and_one_final():
    engine = make_engine(max_num_batched_tokens=8)
    prompt = make_prompts(1, 20, 20)[0]
    outs = run_to_end(engine, [EngineRequest("a", prompt, greedy(5))])["a"]
    assert outs[0].started and not any(o.started for o in outs[1:])
    assert outs[0].new_token_ids == ()  # first step is a prefill chunk that samples nothing
    assert [o.finish_reason for o in outs][-1] is FinishReason.LENGTH
    assert all(o.finish_reason is None for o in outs[:-1])
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(tokens) == 5 and outs[-1].completion_tokens == 5 and outs[-1].prompt_tokens == 20
    assert "".join(o.text_delta for o in outs) == engine.tokenizer.decode(tokens)


def test_stop_string_ends_request_and_is_excluded():
    prompt = make_prompts(1, 10, 10, seed=1)[0]
    plain = run_to_end(make_engine(), [EngineRequest("a", prompt, greedy(30))])["a"]
    text = "".join(o.text_delta for o in plain)
    stop = text[10:13]
    outs = run_to_end(make_engine(), [EngineRequest("a", prompt, greedy(30), stop=(stop,))])["a"]
    assert outs[-1].finish_reason is FinishReason.STOP
    assert "".join(o.text_delta for o in outs) == text[: text.index(stop)]
    assert outs[-1].completion_tokens < 30


def test_eos_stops_unless_ignored():
    prompt = make_prompts(1, 10, 10, seed=2)[0]
    tokens = make_engine().generate([EngineRequest("a", prompt, greedy(12))])["a"]
    stop_on = tokens[4]  # pretend the model's 5th token is a stop token
    out = run_to_end(make_engine(), [EngineRequest("a", prompt, greedy(12, stop_token_ids=(stop_on,)))])["a"]
    assert [t for o in out for t in o.new_token_ids] == tokens[: tokens.index(stop_on) + 1]
    assert out[-1].finish_reason is FinishReason.STOP


def test_abort_frees_blocks_and_reports_once():
    engine = make_engine(enable_prefix_caching=False)
    engine.add_request(EngineRequest("a", make_prompts(1, 30, 30)[0], greedy(100)))
    engine.add_request(EngineRequest("b", make_prompts(1, 30, 30, seed=1)[0], greedy(3)))
    for _ in range(3):
        engine.step()
    [out] = engine.abort_request("a")
    assert out.finish_reason is FinishReason.ABORT and out.completion_tokens == 3
    assert engine.abort_request("a") == []
    while engine.has_unfinished():
        assert all(o.request_id != "a" for o in engine.step())
    assert engine.stats().kv_blocks_used == 0


def test_deadline_expires_without_computing():
    engine = make_engine()
    engine.add_request(EngineRequest("late", (5, 6, 7), greedy(5), deadline=time.monotonic() - 1))
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("late", FinishReason.EXPIRED)]
    assert not engine.has_unfinished() and engine.stats().steps == 0


def test_request_larger_than_cache_is_rejected_with_reason():
    engine = make_engine(block_size=4, num_blocks=4)
    engine.add_request(EngineRequest("big", tuple(range(3, 40)), greedy(4)))
    (out,) = engine.step()
    assert out.finish_reason is FinishReason.REJECTED and "KV blocks" in out.detail
    assert not engine.has_unfinished()


def test_stats_count_steps_forward_time_and_batches():
    engine = make_engine()
    engine.generate([EngineRequest(f"r{i}", p, greedy(4)) for i, p in enumerate(make_prompts(3, 5, 9))])
    stats = engine.stats()
    assert stats.steps == 4 and stats.forward_seconds > 0 and stats.mean_batch_size == 3
    assert stats.forward_by_batch[3][0] == 4 and stats.kv_blocks_total == 256


def test_sampled_requests_with_unseeded_params_still_finish():
    engine = make_engine()
    got = engine.generate(
        [EngineRequest("s", (5, 6, 7), SamplingParams(max_tokens=6, temperature=0.7, top_k=20))]
    )
    assert len(got["s"]) == 6


def test_a_request_reports_the_prompt_tokens_its_prefix_cache_served():
    """Per request, on its last output: the prompt tokens its first scheduling found computed. A prompt
    seen before shares its full blocks (16 tokens each); the same prompt with the cache off, none."""
    prompt = make_prompts(1, 40, 40, seed=3)[0]
    engine = make_engine(block_size=16)
    first = run_to_end(engine, [EngineRequest("a", prompt, greedy(3))])["a"]
    again = run_to_end(engine, [EngineRequest("b", prompt, greedy(3))])["b"]
    other = run_to_end(engine, [EngineRequest("c", prompt[:20] + (7,) * 20, greedy(3))])["c"]
    assert first[-1].cached_tokens == 0
    assert again[-1].cached_tokens == 32  # two full blocks of the 40-token prompt
    assert other[-1].cached_tokens == 16  # only its first block is the same
    off = make_engine(block_size=16, enable_prefix_caching=False)
    run_to_end(off, [EngineRequest("a", prompt, greedy(3))])
    assert run_to_end(off, [EngineRequest("b", prompt, greedy(3))])["b"][-1].cached_tokens == 0
