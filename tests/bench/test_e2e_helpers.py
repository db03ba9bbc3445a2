"""The latency and throughput math of `bench e2e`, and its prompts' token counts (no Kafka, no timing)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.e2e.phases import PRINTABLE, make_jobs
from bench.e2e.stats import (
    Arrival,
    JobTrace,
    completion_tokens,
    e2e_ms,
    itl_ms,
    latency_summary,
    percentile,
    throughput,
    ttft_ms,
)
from gpu.tokenizer import ByteTokenizer


def trace(
    submitted: float, *events: tuple[float, int], usage: int | None = None, final: bool = True
) -> JobTrace:
    """Events (arrival s, tokens); the last one is final (with `usage`) unless final=False."""
    arrivals = [Arrival(at, n) for at, n in events]
    if final and arrivals:
        last = arrivals[-1]
        arrivals[-1] = Arrival(last.at_s, last.tokens, True, usage)
    return JobTrace("job", submitted, tuple(arrivals))


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    values = [5.0, 1.0, 9.0, 3.0, 7.5, 2.0, 8.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edge_cases():
    assert percentile([], 50) is None
    assert percentile([float("nan"), 4.0], 99) == 4.0  # non-finite values are ignored
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=40), st.floats(0, 100), st.floats(0, 100))
def test_percentile_is_monotone_and_bounded(values, q1, q2):
    low, high = sorted((q1, q2))
    assert min(values) <= percentile(values, low) <= percentile(values, high) <= max(values)


def test_ttft_e2e_and_itl_of_a_coalesced_stream():
    # submitted at 10.0; events at +0.2 s (3 tokens), +0.5 s (4 tokens), +0.8 s (2 tokens, final)
    t = trace(10.0, (10.2, 3), (10.5, 4), (10.8, 2), usage=9)
    assert ttft_ms(t) == pytest.approx(200.0)
    assert e2e_ms(t) == pytest.approx(800.0)
    # 6 tokens arrived over the 0.6 s after the first event: 100 ms each (not 0.6 s / 8)
    assert itl_ms(t) == pytest.approx(100.0)
    assert completion_tokens(t) == 9


def test_empty_events_do_not_count_as_first_token():
    # a final event with no tokens (EOS after the last delta) ends the job but carries no token
    t = trace(0.0, (0.1, 0), (0.3, 2), (0.5, 2), (0.6, 0), usage=4)
    assert ttft_ms(t) == pytest.approx(300.0)
    assert itl_ms(t) == pytest.approx(100.0)  # 0.2 s for the 2 tokens of the last non-empty event
    assert e2e_ms(t) == pytest.approx(600.0)


def test_single_event_job_has_no_itl_and_unfinished_job_has_no_e2e():
    assert itl_ms(trace(0.0, (0.4, 5), usage=5)) is None
    unfinished = trace(0.0, (0.4, 5), final=False)
    assert e2e_ms(unfinished) is None
    assert not unfinished.finished
    assert completion_tokens(unfinished) == 5  # no usage yet: the tokens streamed


def test_latency_summary_counts_jobs_per_metric():
    traces = [
        trace(0.0, (0.1, 1), (0.3, 2), usage=3),  # ttft 100, itl 100, e2e 300
        trace(1.0, (1.3, 4), usage=4),  # ttft 300, no itl, e2e 300
        trace(2.0, (2.2, 1), final=False),  # ttft 200, unfinished
    ]
    s = latency_summary(traces)
    assert (s["jobs"], s["finished"], s["ttft_n"], s["itl_n"], s["e2e_n"]) == (3, 2, 3, 1, 2)
    assert s["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["ttft_p99_ms"] == pytest.approx(percentile([100.0, 300.0, 200.0], 99))
    assert s["itl_p50_ms"] == pytest.approx(100.0)
    assert s["e2e_p99_ms"] == pytest.approx(300.0)


def test_throughput_spans_first_submit_to_last_final_event():
    traces = [trace(1.0, (1.5, 10), usage=10), trace(1.2, (1.4, 1), (3.0, 5), usage=6)]
    tokens, wall = throughput(traces)
    assert tokens == 16
    assert wall == pytest.approx(2.0)
    tokens, wall = throughput([*traces, trace(1.1, (1.3, 2), final=False)])
    assert (tokens, wall) == (18, None)  # an unfinished job: no wall time to divide by


def test_prompts_tokenize_to_the_wanted_counts():
    jobs = make_jobs([(16, 8), (128, 256), (1, 4)], "seed", "t")
    tokenizer = ByteTokenizer()
    assert [len(tokenizer.encode(j.prompt)) for j in jobs] == [16, 128, 2]  # BOS + chars; never empty
    assert [j.max_tokens for j in jobs] == [8, 256, 4]
    assert all(set(j.prompt) <= set(PRINTABLE) for j in jobs)
    assert make_jobs([(16, 8)], "seed", "t") == jobs[:1]
    assert make_jobs([(16, 8)], "other", "t")[0].prompt != jobs[0].prompt
