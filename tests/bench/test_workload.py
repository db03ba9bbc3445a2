"""The benchmark's workload generator, FLOP counter and report (fast: tiny models, no timing)."""

from __future__ import annotations

import json
import math

import pytest

from bench.engine.flops import ModelShape, request_flops, shape_of, workload_flops
from bench.engine.summary import REQUIRED_KEYS, render, summarize
from bench.report import format_table, write_json
from bench.workload import WorkloadSpec, check_lengths, compare_tokens, make_workload, parse_range
from tests.bench.conftest import make_raw, make_requests, make_result


def test_workload_is_deterministic_and_within_bounds():
    spec = WorkloadSpec(requests=50, prompt_len=(16, 128), output_len=(8, 256), seed=3)
    first, second = make_workload(spec, 32000), make_workload(spec, 32000)
    assert first == second
    assert len(first) == 50
    assert len({r.request_id for r in first}) == 50
    assert all(16 <= len(r.prompt_token_ids) <= 128 for r in first)
    assert all(8 <= r.max_new_tokens <= 256 for r in first)
    assert all(0 <= t < 32000 for r in first for t in r.prompt_token_ids)


def test_workload_depends_on_seed():
    assert make_requests(seed=0) != make_requests(seed=1)


@pytest.mark.parametrize("bounds", [(0, 5), (6, 5)])
def test_spec_rejects_bad_ranges(bounds):
    with pytest.raises(ValueError):
        WorkloadSpec(prompt_len=bounds)


def test_parse_range():
    assert parse_range("16:128") == (16, 128)
    assert parse_range("32") == (32, 32)


def test_length_check_and_token_comparison(requests):
    exact = make_result(requests, 1.0)
    short = make_result(requests, 1.0, short=(requests[2].request_id,))
    assert check_lengths(requests, exact.tokens) == []
    assert check_lengths(requests, short.tokens) == [requests[2].request_id]
    comparison = compare_tokens(requests, exact.tokens, short.tokens)
    assert comparison["identical"] == len(requests) - 1
    assert comparison["first_divergence"] == {requests[2].request_id: requests[2].max_new_tokens - 1}


def _tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_shape_counts_the_decoder_matmuls():
    shape = shape_of(_tiny_model())
    hidden, kv, inter = 64, 2 * 16, 96
    per_layer = hidden * hidden * 2 + hidden * kv * 2 + 3 * hidden * inter  # q, o, k, v, gate, up, down
    assert shape == ModelShape(
        body_linear_params=2 * per_layer, num_layers=2, attn_dim=64, lm_head_params=6400
    )


def test_request_flops_match_a_counted_prefill():
    """One prefill that samples one token, counted by torch's FLOP counter, equals request_flops(P, 1).

    The counter charges the full P x P attention square (causal masking skips none of it), so that
    difference is accounted for explicitly; everything else (matmuls, lm_head on one row) must agree.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model = _tiny_model()
    model.set_attn_implementation("eager")
    shape, prompt = shape_of(model), 10
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(torch.arange(prompt).unsqueeze(0), logits_to_keep=1)
    counted = counter.get_total_flops()
    square = 4 * shape.attn_dim * shape.num_layers * prompt * prompt
    causal = 4 * shape.attn_dim * shape.num_layers * prompt * (prompt + 1) // 2
    assert request_flops(shape, prompt, 1) == counted - square + causal


def test_decode_flops_grow_with_context():
    shape = ModelShape(body_linear_params=1000, num_layers=2, attn_dim=16, lm_head_params=5000)
    one_more = request_flops(shape, 10, 3) - request_flops(shape, 10, 2)
    # one more decode position (index 11, 12 keys) and one more sampled token
    assert one_more == 2 * 1000 + 4 * 16 * 2 * 12 + 2 * 5000
    requests = make_requests()
    assert workload_flops(shape, requests) == sum(
        request_flops(shape, len(r.prompt_token_ids), r.max_new_tokens) for r in requests
    )


def test_summary_has_the_required_keys_and_ratios(requests, tmp_path):
    inferq_extras = {"forward_seconds": 0.9, "forward_fraction": 0.9, "mean_batch_size": 4.0}
    runs = {
        "static": [make_result(requests, 4.0), make_result(requests, 4.0)],
        "hf_cb": [make_result(requests, 2.0), make_result(requests, 2.0)],
        "inferq": [make_result(requests, 1.0, extras=inferq_extras)] * 2,
    }
    useful = sum(r.max_new_tokens for r in requests)
    payload = summarize(make_raw(requests, runs, flops_per_s=[1e9, 1e9]), {"cpu_model": "test"}, None)
    assert set(REQUIRED_KEYS) <= payload.keys()
    assert payload["inferq_tok_s"] == pytest.approx(useful)
    assert payload["ratio_vs_static"] == pytest.approx(4.0)
    assert payload["ratio_vs_hf_cb"] == pytest.approx(2.0)
    assert payload["cpu_ratio_vs_static"] == pytest.approx(4.0)
    assert payload["limit_tok_s"] == pytest.approx(useful)  # 10^9 FLOPs at 10^9 FLOP/s: one second
    assert payload["limit_fraction"] == pytest.approx(1.0)
    assert payload["forward_fraction"] == pytest.approx(0.9)
    assert payload["correctness"]["length_errors"] == {"static": [], "hf_cb": [], "inferq": []}
    path = write_json(tmp_path / "out" / "engine.json", payload)
    assert set(REQUIRED_KEYS) <= json.loads(path.read_text()).keys()
    assert "inferq" in render(payload)


def test_short_outputs_count_only_what_was_produced(requests):
    bad = requests[0].request_id
    payload = summarize(make_raw(requests, {"static": [make_result(requests, 1.0, short=(bad,))]}), {}, None)
    assert payload["static_tok_s"] == sum(r.max_new_tokens for r in requests) - 1
    assert payload["correctness"]["length_errors"]["static"] == [bad]
    assert payload["inferq_tok_s"] is None and payload["ratio_vs_static"] is None


def test_json_writes_nan_as_null(tmp_path):
    path = write_json(tmp_path / "x.json", {"a": math.nan, "b": [1.5, math.inf]})
    assert json.loads(path.read_text()) == {"a": None, "b": [1.5, None]}


def test_table_aligns_columns():
    lines = format_table(["name", "tok/s"], [["static", 400.0], ["inferq", 2500.25]]).splitlines()
    assert lines[2] == "static    400.0"
    assert lines[3] == "inferq  2,500.2"
    assert len({len(line) for line in lines}) == 1


def test_the_backlog_slope_is_a_least_squares_line():
    from bench.e2e.backlog import slope_mib_per_1k_jobs

    assert slope_mib_per_1k_jobs([(0, 100.0), (1000, 110.0), (2000, 120.0)]) == pytest.approx(10.0)
    assert slope_mib_per_1k_jobs([(0, 100.0), (1000, 100.0)]) == 0.0
    assert slope_mib_per_1k_jobs([(5, 1.0)]) == 0.0
