"""Prometheus metrics of one worker, named and labelled after vLLM's (`vllm:` → `inferq:`) where they mean
the same: engine and request metrics carry `model_name`, the success counter `finished_reason`, so
dashboards and alerts written for vLLM read them with the prefix changed. LoRA adapters: vLLM's
`lora_requests_info` gauge (the adapters of running and waiting jobs), and the success counter's
`lora_name` (the adapter's, "" for the base), the name vLLM's LoRARequest gives it."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from schemas.jobs import Timings
from workers.kafka_io import Membership
from workers.serving.health_server import Health, serve

# a rebalance, or a first join after a slow model load, takes seconds; a minute out means something is wrong
GROUP_ABSENCE_UNHEALTHY_S = 60.0
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)


class WorkerMetrics:
    def __init__(self, model_name: str = "unknown", max_loras: int = 4) -> None:
        self.model_name = model_name
        self.max_loras = max_loras
        self.registry = CollectorRegistry()
        r = self.registry
        by_class = ["model_name", "priority"]

        def latency(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, by_class, buckets=buckets, registry=r)

        self.ttft = latency("inferq:time_to_first_token_seconds", "Time from posting to the first token.")
        self.itl = latency(
            "inferq:inter_token_latency_seconds", "Time between consecutive output tokens.", _ITL_BUCKETS
        )
        self.e2e = latency("inferq:e2e_request_latency_seconds", "Time from posting to the final token.")
        self.queue_time = latency("inferq:request_queue_time_seconds", "Time from posting to the first step.")
        self.running = Gauge(
            "inferq:num_requests_running", "Sequences in the batch.", ["model_name"], registry=r
        )
        self.waiting = Gauge(
            "inferq:num_requests_waiting", "Sequences waiting, per class.", by_class, registry=r
        )
        self.kv_usage = Gauge(
            "inferq:kv_cache_usage_perc", "Fraction of KV blocks in use.", ["model_name"], registry=r
        )
        self.preemptions = Counter(
            "inferq:num_preemptions", "Sequences preempted.", ["model_name"], registry=r
        )
        self.prompt_tokens = Counter(
            "inferq:prompt_tokens", "Prompt tokens admitted.", ["model_name"], registry=r
        )
        self.generation_tokens = Counter(
            "inferq:generation_tokens", "Tokens generated.", ["model_name"], registry=r
        )
        self.prefix_queries = Counter(
            "inferq:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            ["model_name"],
            registry=r,
        )
        self.prefix_hits = Counter(
            "inferq:prefix_cache_hits", "Prompt tokens found in the prefix cache.", ["model_name"], registry=r
        )
        self.finished = Counter(
            "inferq:request_success",
            "Jobs ended, by finish reason (stop, length, abort, expired, rejected, error) and job status.",
            ["model_name", "finished_reason", "status", "lora_name"],
            registry=r,
        )
        self.lora_info = Gauge(
            "inferq:lora_requests_info",
            "Adapters of the jobs running and waiting here (comma-separated), as vLLM's; the value is when "
            "that was seen (unix seconds).",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )
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
        # a job's later attempts (its worker died, stopped, or lost its partition): resumed from the tokens
        # earlier attempts saved, or restarted from scratch (reason: no_progress, model_changed, refused)
        self.attempts = Counter(
            "inferq:job_attempts",
            "Later attempts of jobs, by outcome (resumed, restarted) and why one restarted.",
            ["model_name", "outcome", "reason"],
            registry=r,
        )
        self.resumed_tokens = Counter(
            "inferq:resumed_tokens",
            "Tokens earlier attempts saved that resumed attempts continued from (not generated again).",
            ["model_name"],
            registry=r,
        )
        self.recomputed_tokens = Counter(
            "inferq:recomputed_tokens",
            "Tokens earlier attempts saved that restarted attempts generate again (their progress unusable).",
            ["model_name"],
            registry=r,
        )
        self.engine_step_failures = Counter(
            "inferq:engine_step_failures",
            "Engine steps that raised (their sequences are then run alone to find the one at fault).",
            registry=r,
        )
        self.health = Health()
        self.healthy = Gauge(
            "inferq:healthy", "1 while the worker serves; 0 while its steps fail.", registry=r
        )
        self.healthy.set(1)
        self.group_member = Gauge(
            "inferq:group_member", "1 while the worker is a stable member of its consumer group.", registry=r
        )
        self.group_losses = Gauge(
            "inferq:group_membership_losses",
            "Times the group dropped the worker without its client noticing (it then rejoined).",
            registry=r,
        )
        self.partition_stalls = Gauge(
            "inferq:partition_stalls",
            "Partitions the Kafka client stopped fetching with records waiting (each was positioned again).",
            registry=r,
        )
        self.loop_seconds = Counter(
            "inferq:loop_seconds",
            "Engine-loop time by phase (step = inside engine.step()).",
            ["phase"],
            registry=r,
        )
        self.loop_thread = Counter(
            "inferq:loop_thread_seconds",
            "The engine loop thread's seconds on a core (cpu) and runnable waiting for one (runqueue).",
            ["kind"],
            registry=r,
        )
        # series that exist from the start (at 0), so rates and ratios have data before the first event
        for per_model in (self.running, self.kv_usage, self.preemptions, self.prompt_tokens,
                          self.generation_tokens, self.prefix_queries, self.prefix_hits, self.resumed_tokens,
                          self.recomputed_tokens):  # fmt: skip
            per_model.labels(model_name)
        # children looked up once: `labels()` costs more than the observation (called per job per step)
        self._generated = self.generation_tokens.labels(model_name)
        self._itl: dict[str, Any] = {}
        # labelled children of the per-job metrics, looked up once: `labels()` is a lock and a dict build
        # per call, several per job (these labels are never removed)
        self._children: dict[tuple[Any, ...], Any] = {}
        self._preemptions_seen = 0
        self._prefix_hits_seen = 0
        self._lag_labels: set[tuple[str, str]] = set()
        self._loop_seen: dict[str, float] = {}
        self._lora_labels: tuple[str, str, str] | None = None

    def serve(self, port: int) -> None:
        """/metrics and /health on this port (all interfaces), from a thread of their own."""
        serve(port, self.registry, self.health)

    def set_health(self, healthy: bool, why: str = "", concern: str = "engine") -> None:
        self.health.set(healthy, why, concern)
        self.healthy.set(0 if self.health.problem else 1)

    def observe_membership(self, membership: Membership) -> None:
        """Out of the group for longer than a rebalance takes: it reads no jobs, so /health says so."""
        self.group_member.set(1 if membership.member else 0)
        self.group_losses.set(membership.losses)
        self.partition_stalls.set(membership.stalls)
        out = membership.out_for_s > GROUP_ABSENCE_UNHEALTHY_S
        self.set_health(not out, f"out of its consumer group for {membership.out_for_s:.0f} s", "group")

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_admitted(self, prompt_tokens: int) -> None:
        """A job handed to the engine: its prompt is counted, and looked up in the prefix cache."""
        self._child(self.prompt_tokens, self.model_name).inc(prompt_tokens)
        self._child(self.prefix_queries, self.model_name).inc(prompt_tokens)

    def observe_tokens(self, priority: str, count: int, gap_s: float | None) -> None:
        """`count` new tokens of a job, `gap_s` after its previous ones (None for its first): every gap
        between consecutive tokens is one ITL observation, as vLLM observes them."""
        self._generated.inc(count)
        if gap_s is not None and count:
            itl = self._itl.get(priority)
            if itl is None:
                itl = self._itl[priority] = self.itl.labels(self.model_name, priority)
            for _ in range(count):
                itl.observe(gap_s / count)

    def observe_resumed(self, tokens: int) -> None:
        """A later attempt of a job continues from `tokens` saved tokens."""
        self._child(self.attempts, self.model_name, "resumed", "").inc()
        self._child(self.resumed_tokens, self.model_name).inc(tokens)

    def observe_restarted(self, reason: str, saved_tokens: int) -> None:
        """A later attempt of a job starts from scratch (`saved_tokens`: what it could not use)."""
        self._child(self.attempts, self.model_name, "restarted", reason).inc()
        self._child(self.recomputed_tokens, self.model_name).inc(saved_tokens)

    def observe_finished(self, status: str, finish_reason: str, lora_name: str = "") -> None:
        self._child(self.finished, self.model_name, finish_reason, status, lora_name).inc()

    def observe_job(
        self, status: str, finish_reason: str, priority: str, timings: Timings, lora_name: str = ""
    ) -> None:
        self.observe_finished(status, finish_reason, lora_name)
        for hist, value in (
            (self.ttft, timings.ttft_ms),
            (self.e2e, timings.e2e_ms),
            (self.queue_time, timings.queue_ms),
        ):
            if value is not None:
                self._child(hist, self.model_name, priority).observe(value / 1000)

    def observe_loras(self, running: Iterable[str], waiting: Iterable[str]) -> None:
        """The adapters of the jobs running and waiting here: one series, its labels replaced as they
        change (vLLM adds one per combination and keeps them all; a scrape then has to find the newest)."""
        labels = (str(self.max_loras), ",".join(sorted(set(running))), ",".join(sorted(set(waiting))))
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                self.lora_info.remove(*self._lora_labels)
            self._lora_labels = labels
        self.lora_info.labels(*labels).set(time.time())

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

    def observe_loop(self, seconds: dict[str, float], thread: dict[str, float]) -> None:
        """Cumulative loop seconds by phase, and the loop thread's own (`cpu`, `runqueue`) seconds."""
        for counter, totals, prefix in ((self.loop_seconds, seconds, ""), (self.loop_thread, thread, "t:")):
            for name, total in totals.items():
                delta = total - self._loop_seen.get(prefix + name, 0.0)
                if delta > 0:
                    counter.labels(name).inc(delta)
                    self._loop_seen[prefix + name] = total

    def observe_engine(
        self,
        running: int,
        waiting: dict[str, int],
        kv_used: int,
        kv_total: int,
        preemptions_total: int,
        prefix_hits_total: int,
    ) -> None:
        model = self.model_name
        self.running.labels(model).set(running)
        for priority, n in waiting.items():
            self.waiting.labels(model, priority).set(n)
        self.kv_usage.labels(model).set(kv_used / kv_total if kv_total else 0.0)
        # the engine counts totals since it started; counters move by what is new
        if preemptions_total > self._preemptions_seen:
            self.preemptions.labels(model).inc(preemptions_total - self._preemptions_seen)
            self._preemptions_seen = preemptions_total
        if prefix_hits_total > self._prefix_hits_seen:
            self.prefix_hits.labels(model).inc(prefix_hits_total - self._prefix_hits_seen)
            self._prefix_hits_seen = prefix_hits_total
