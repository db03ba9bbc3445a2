"""The near-tie check of `bench engine`: the reference model's logit gap where greedy tokens diverge."""

from __future__ import annotations

from dataclasses import replace

import torch

from bench.engine.models import load_hf_model
from bench.engine.near_ties import NEAR_TIE, logit_gaps, near_ties
from bench.engine.summary import render, summarize
from bench.workload import BenchRequest
from tests.bench.conftest import make_raw, make_result


def _greedy_and_alternatives(prompt: list[int], steps: int) -> tuple[list[int], float, int, float, int]:
    """The tiny model's greedy tokens; at the last step: the largest |logit|, the runner-up token, its gap
    to the best one, and the worst token."""
    model = load_hf_model("tiny")
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        top = logits.topk(2)
    gap = float(top.values[0] - top.values[1])
    return ids[len(prompt) :], logits.abs().max().item(), int(top.indices[1]), gap, int(logits.argmin())


def test_the_gap_is_the_reference_models_own_logit_difference_at_the_divergence():
    prompt = [5, 17, 301, 42, 7]
    greedy, scale, runner_up, top_gap, worst = _greedy_and_alternatives(prompt, 4)
    other = greedy[:3] + [runner_up]  # leaves the reference at its 4th token, for the second-best one
    request = BenchRequest("r0", tuple(prompt), 4)
    gaps = logit_gaps("tiny", (request,), {"r0": greedy}, {"r0": other}, {"r0": 3})
    assert abs(gaps["r0"] - top_gap / scale) < 1e-5
    far = logit_gaps("tiny", (request,), {"r0": greedy}, {"r0": greedy[:3] + [worst]}, {"r0": 3})
    assert far["r0"] > gaps["r0"] and far["r0"] > NEAR_TIE


def test_an_early_stop_is_not_measured_and_ties_are_counted_by_the_threshold():
    request = BenchRequest("r0", (1, 2, 3), 4)
    assert logit_gaps("tiny", (request,), {"r0": [4, 5, 6]}, {"r0": [4]}, {"r0": 1}) == {}
    assert near_ties({"a": NEAR_TIE / 2, "b": NEAR_TIE * 2, "c": 0.0}) == 2


def test_the_report_shows_near_ties_next_to_identical_requests(requests):
    static = make_result(requests, 2.0)
    inferq = make_result(requests, 1.0)
    inferq.tokens[requests[0].request_id][0] = 999  # leaves static's tokens at once
    raw = make_raw(requests, {"static": [static], "inferq": [inferq]})
    raw = replace(raw, logit_gaps={"inferq": {requests[0].request_id: NEAR_TIE / 10}})
    payload = summarize(raw, {}, None)
    greedy = payload["correctness"]["greedy_vs_static"]["inferq"]
    assert greedy["identical"] == len(requests) - 1 and greedy["near_ties"] == 1
    assert f"{len(requests) - 1}/{len(requests)} +1 tie" in render(payload)
