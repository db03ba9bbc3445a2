"""Prometheus metrics of one worker, named after vLLM's (`vllm:` → `inferq:`) where they mean the same."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from schemas.jobs import Timings

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "inferq:time_to_first_token_seconds",
            "Time from posting to the first token.",
            ["priority"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "inferq:inter_token_latency_seconds",
            "Mean time between output tokens of a job.",
            ["priority"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "inferq:e2e_request_latency_seconds",
            "Time from posting to the final token.",
            ["priority"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "inferq:request_queue_time_seconds",
            "Time from posting to the first schedule.",
            ["priority"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("inferq:num_requests_running", "Sequences in the batch.", registry=r)
        self.waiting = Gauge(
            "inferq:num_requests_waiting", "Sequences waiting, per class.", ["priority"], registry=r
        )
        self.kv_usage = Gauge("inferq:kv_cache_usage_perc", "Fraction of KV blocks in use.", registry=r)
        self.preemptions = Counter("inferq:num_preemptions", "Sequences preempted.", registry=r)
        self.prompt_tokens = Counter("inferq:prompt_tokens", "Prompt tokens admitted.", registry=r)
        self.generation_tokens = Counter("inferq:generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter("inferq:request_success", "Jobs ended, by status.", ["status"], registry=r)
        self.rejected = Counter(
            "inferq:requests_rejected", "Records sent to the DLQ, by reason.", ["reason"], registry=r
        )
        self.consumer_lag = Gauge(
            "inferq:consumer_lag",
            "Records not yet read, per owned partition.",
            ["topic", "partition"],
            registry=r,
        )
        self.persister_depth = Gauge("inferq:persister_queue_depth", "Row writes waiting.", registry=r)
        self.persister_age = Gauge(
            "inferq:persister_oldest_age_seconds", "Age of the oldest waiting row write.", registry=r
        )
        self.unpublished = Gauge(
            "inferq:unpublished_results", "Terminal rows whose result is not published yet.", registry=r
        )
        self.token_events_dropped = Counter(
            "inferq:token_events_dropped", "Token events the broker could not take in time.", registry=r
        )
        self.loop_seconds = Counter(
            "inferq:loop_seconds",
            "Engine-loop time by phase (step = inside engine.step()).",
            ["phase"],
            registry=r,
        )
        self._preemptions_seen = 0
        self._lag_labels: set[tuple[str, str]] = set()
        self._loop_seen: dict[str, float] = {}

    def serve(self, port: int) -> None:
        start_http_server(port, addr="0.0.0.0", registry=self.registry)

    def observe_job(self, status: str, priority: str, timings: Timings) -> None:
        self.finished.labels(status).inc()
        for hist, value in (
            (self.ttft, timings.ttft_ms),
            (self.itl, timings.mean_itl_ms),
            (self.e2e, timings.e2e_ms),
            (self.queue_time, timings.queue_ms),
        ):
            if value is not None:
                hist.labels(priority).observe(value / 1000)

    def observe_intake(
        self, lag: dict[tuple[str, int], int], depth: int, oldest_age_s: float, unpublished: int
    ) -> None:
        labels = {(t, str(p)) for t, p in lag}
        for gone in self._lag_labels - labels:  # partitions no longer owned
            self.consumer_lag.remove(*gone)
        self._lag_labels = labels
        for (topic, partition), n in lag.items():
            self.consumer_lag.labels(topic, str(partition)).set(n)
        self.persister_depth.set(depth)
        self.persister_age.set(oldest_age_s)
        self.unpublished.set(unpublished)

    def observe_loop(self, seconds: dict[str, float]) -> None:
        for phase, total in seconds.items():
            delta = total - self._loop_seen.get(phase, 0.0)
            if delta > 0:
                self.loop_seconds.labels(phase).inc(delta)
                self._loop_seen[phase] = total

    def observe_engine(
        self, running: int, waiting: dict[str, int], kv_used: int, kv_total: int, preemptions_total: int
    ) -> None:
        self.running.set(running)
        for priority, n in waiting.items():
            self.waiting.labels(priority).set(n)
        self.kv_usage.set(kv_used / kv_total if kv_total else 0.0)
        if preemptions_total > self._preemptions_seen:
            self.preemptions.inc(preemptions_total - self._preemptions_seen)
            self._preemptions_seen = preemptions_total
