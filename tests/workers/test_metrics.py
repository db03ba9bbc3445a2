"""Worker metrics as operators read them: vLLM-compatible labels, ITL per token gap, prefix-cache counters,
and a Grafana dashboard whose every query names metrics and labels the worker really exports."""

from __future__ import annotations

import json
import re

from prometheus_client import generate_latest
from prometheus_client.metrics import MetricWrapperBase

from schemas.jobs import Timings
from workers.serving.metrics import WorkerMetrics
from workers.settings import REPO_ROOT

DASHBOARD = REPO_ROOT / "docs" / "grafana-inferq.json"
PROMETHEUS_LABELS = {"instance", "job"}  # added by the scrape


def samples(metrics: WorkerMetrics) -> dict[str, float]:
    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def exported(metrics: WorkerMetrics) -> dict[str, set[str]]:
    """Every series name a scrape can show, with the labels it carries."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names: dict[str, set[str]] = {}
    for collector in vars(metrics).values():
        if not isinstance(collector, MetricWrapperBase):
            continue
        family = collector.describe()[0]
        labels = set(collector._labelnames)  # no public accessor; stable across prometheus_client releases
        for suffix in suffixes[family.type]:
            names[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return names


def test_success_counter_and_latencies_carry_vllm_labels():
    m = WorkerMetrics("smollm2")
    m.observe_job("succeeded", "length", "high", Timings(ttft_ms=20, e2e_ms=100, queue_ms=5))
    m.observe_finished("cancelled", "abort")
    m.observe_job("succeeded", "stop", "low", Timings(e2e_ms=10), lora_name="acme/extract")
    s = samples(m)
    success = "inferq:request_success_total"
    assert s[success + '{finished_reason="length",lora_name="",model_name="smollm2",status="succeeded"}'] == 1
    assert s[success + '{finished_reason="abort",lora_name="",model_name="smollm2",status="cancelled"}'] == 1
    labels = 'finished_reason="stop",lora_name="acme/extract",model_name="smollm2",status="succeeded"'
    assert s[success + "{" + labels + "}"] == 1
    assert s['inferq:time_to_first_token_seconds_count{model_name="smollm2",priority="high"}'] == 1
    assert s['inferq:time_to_first_token_seconds_sum{model_name="smollm2",priority="high"}'] == 0.02


def test_lora_requests_info_names_the_adapters_of_running_and_waiting_jobs_in_one_series():
    m = WorkerMetrics("m", max_loras=2)
    m.observe_loras(["b", "a", "b"], ["c"])
    m.observe_loras(["a"], [])
    info = {k: v for k, v in samples(m).items() if k.startswith("inferq:lora_requests_info")}
    # vLLM's gauge: the labels name the adapters (comma-separated), the value is when; the stale one is gone
    assert list(info) == [
        'inferq:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""}'
    ]
    assert list(info.values())[0] > 1.7e9


def test_itl_is_observed_per_token_gap_not_per_job():
    m = WorkerMetrics("m")
    m.observe_tokens("normal", 1, None)  # the first token: no gap
    for gap in (0.01, 0.03, 0.2):
        m.observe_tokens("normal", 1, gap)
    m.observe_tokens("normal", 2, 0.04)  # two tokens in one output: two gaps of 20 ms
    s = samples(m)
    labels = 'model_name="m",priority="normal"'
    assert s[f"inferq:inter_token_latency_seconds_count{{{labels}}}"] == 5
    assert abs(s[f"inferq:inter_token_latency_seconds_sum{{{labels}}}"] - 0.28) < 1e-9
    assert s[f'inferq:inter_token_latency_seconds_bucket{{le="0.02",{labels}}}'] == 3  # 10 ms, 20 ms, 20 ms
    assert s['inferq:generation_tokens_total{model_name="m"}'] == 6


def test_prefix_cache_counters_move_by_what_is_new():
    m = WorkerMetrics("m")
    m.observe_admitted(100)
    m.observe_admitted(60)
    m.observe_engine(1, {"high": 0}, 3, 10, preemptions_total=0, prefix_hits_total=32)
    m.observe_engine(1, {"high": 2}, 4, 10, preemptions_total=1, prefix_hits_total=48)
    s = samples(m)
    assert s['inferq:prefix_cache_queries_total{model_name="m"}'] == 160
    assert s['inferq:prefix_cache_hits_total{model_name="m"}'] == 48
    assert s['inferq:num_preemptions_total{model_name="m"}'] == 1
    assert s['inferq:num_requests_waiting{model_name="m",priority="high"}'] == 2
    assert s['inferq:kv_cache_usage_perc{model_name="m"}'] == 0.4


def test_the_dashboard_queries_only_metrics_and_labels_the_worker_exports():
    dashboard = json.loads(DASHBOARD.read_text())
    names = exported(WorkerMetrics("m"))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs.append(dashboard["templating"]["list"][1]["query"])
    assert len(exprs) >= 20
    for expr in exprs:
        used = set(re.findall(r"inferq:[a-z0-9_:]+", expr))
        assert used, expr
        assert used <= set(names), f"{expr}: unknown {used - set(names)}"
        labels = set().union(*(names[n] for n in used)) | PROMETHEUS_LABELS
        grouped = {g.strip() for by in re.findall(r"by \(([^)]*)\)", expr) for g in by.split(",")}
        selected = set(re.findall(r"([a-z_]+)=~?\"", expr))
        assert grouped | selected <= labels, f"{expr}: unknown labels {(grouped | selected) - labels}"


def test_the_dashboard_covers_what_operators_watch():
    text = DASHBOARD.read_text()
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "generation_tokens",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions",
                 "requests_rejected", "consumer_lag", "persister_queue_depth", "unpublished_results",
                 "prefix_cache_hits"):  # fmt: skip
        assert f"inferq:{name}" in text


def test_the_health_endpoint_turns_503_with_the_reason_and_metrics_stay_served():
    import socket
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = WorkerMetrics("m")
    metrics.serve(port)
    base = f"http://127.0.0.1:{port}"
    assert urllib.request.urlopen(f"{base}/health", timeout=5).read() == b"ok"
    metrics.set_health(False, "engine steps failing")
    try:
        urllib.request.urlopen(f"{base}/health", timeout=5)
        raise AssertionError("an unhealthy worker answered 200")
    except urllib.error.HTTPError as err:
        assert err.code == 503 and err.read() == b"engine steps failing"
    body = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    assert "inferq:healthy 0.0" in body


def test_health_names_each_concern_and_recovers_each_alone():
    from workers.kafka_io import Membership

    metrics = WorkerMetrics("m")
    metrics.set_health(False, "engine steps failing")
    metrics.observe_membership(Membership(member=False, out_for_s=75.0, losses=1))
    assert metrics.health.problem == "engine steps failing; out of its consumer group for 75 s"
    metrics.set_health(True)  # the engine recovers; the group problem stays
    assert metrics.health.problem == "out of its consumer group for 75 s"
    assert metrics.healthy._value.get() == 0
    metrics.observe_membership(Membership(member=False, out_for_s=5.0, losses=1))  # a rebalance: not yet
    assert metrics.health.problem is None and metrics.healthy._value.get() == 1
    metrics.observe_membership(Membership(member=True, out_for_s=0.0, losses=1, stalls=2))
    assert metrics.group_member._value.get() == 1 and metrics.group_losses._value.get() == 1
    assert metrics.partition_stalls._value.get() == 2
