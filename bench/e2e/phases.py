"""The measurements of `bench e2e`: the engine alone, and jobs through Kafka → worker → Kafka.

Jobs are text prompts of random printable ASCII: the byte-level tokenizer turns N-1 characters into N
tokens (BOS + one per byte), so a prompt has the workload's token count. Every repetition draws fresh
characters (same lengths), so neither the worker's nor the engine's prefix cache ever serves a prompt
seen before.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from bench.e2e.deploy import TokenRecorder, WorkerProcess
from bench.e2e.stats import JobTrace, latency_summary, per_job, ttft_ms
from bench.workload import WorkloadSpec, make_workload

PRINTABLE = "".join(chr(c) for c in range(32, 127))


@dataclass(frozen=True)
class BenchJob:
    job_id: str
    prompt: str
    max_tokens: int

    def request(self) -> dict[str, Any]:
        # The worker's defaults otherwise: greedy, no stop strings, EOS ends a job.
        return {"job_id": self.job_id, "prompt": self.prompt, "max_tokens": self.max_tokens}


def workload_lengths(spec: WorkloadSpec, vocab_size: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of the engine benchmark's workload for this spec."""
    return [(len(r.prompt_token_ids), r.max_new_tokens) for r in make_workload(spec, vocab_size)]


def random_lengths(rng: random.Random, count: int, prompt: tuple[int, int], output: tuple[int, int]) -> list:
    return [(rng.randint(*prompt), rng.randint(*output)) for _ in range(count)]


def make_jobs(lengths: list[tuple[int, int]], text_seed: str, tag: str) -> list[BenchJob]:
    rng = random.Random(text_seed)
    return [
        BenchJob(f"{tag}-{i:04d}", "".join(rng.choice(PRINTABLE) for _ in range(max(1, p - 1))), out)
        for i, (p, out) in enumerate(lengths)
    ]


# ---- the engine alone, in this process -----------------------------------------------------------


def engine_run(engine: Any, jobs: list[BenchJob]) -> tuple[int, float]:
    """(completion tokens, wall s): all jobs added at once, stepped to the end; as the worker builds them."""
    from gpu.engine import EngineRequest
    from scheduler.types import SamplingParams

    max_len = engine.scheduler.config.max_model_len
    tokens = 0
    start = time.perf_counter()
    for job in jobs:
        ids = tuple(engine.tokenizer.encode(job.prompt))
        sampling = SamplingParams(max_tokens=min(job.max_tokens, max_len - len(ids)), temperature=0.0)
        engine.add_request(EngineRequest(request_id=job.job_id, prompt_token_ids=ids, sampling=sampling))
    while engine.has_unfinished():
        for output in engine.step():
            tokens += len(output.new_token_ids)
    return tokens, time.perf_counter() - start


# ---- through the worker --------------------------------------------------------------------------


class Session:
    """Submits jobs with the project's client and reads their fate from the token recorder."""

    def __init__(self, client: Any, recorder: TokenRecorder, worker: WorkerProcess, timeout_s: float) -> None:
        self.client = client
        self.recorder = recorder
        self.worker = worker
        self.timeout_s = timeout_s

    def submit(self, job: BenchJob, priority: str) -> float:
        """Post one job (the client returns once the broker has it); when it was posted."""
        at = time.perf_counter()
        self.client.submit(job.request(), priority)
        return at

    def finish(self, submitted: dict[str, float]) -> list[JobTrace]:
        self.recorder.wait_finished(list(submitted), self.timeout_s, self.worker)
        return self.recorder.traces(submitted)

    def burst(self, jobs: list[BenchJob], priority: str = "normal") -> list[JobTrace]:
        """All jobs submitted at once (one round of batching), then wait for every final event."""
        return self.finish(self.submit_all(jobs, priority))

    def submit_all(self, jobs: list[BenchJob], priority: str) -> dict[str, float]:
        at = time.perf_counter()
        self.client.submit_many([job.request() for job in jobs], priority)
        return dict.fromkeys((job.job_id for job in jobs), at)

    def poisson(self, jobs: list[BenchJob], rate: float, rng: random.Random) -> list[JobTrace]:
        """Jobs arriving as a Poisson process of `rate` jobs/s (exponential gaps), each sent at once."""
        submitted: dict[str, float] = {}
        due = time.perf_counter()
        for job in jobs:
            due += rng.expovariate(rate)
            _sleep_until(due)
            submitted[job.job_id] = self.submit(job, "normal")
        return self.finish(submitted)

    def spaced(self, jobs: list[BenchJob], gap_s: float, priority: str) -> list[JobTrace]:
        submitted: dict[str, float] = {}
        due = time.perf_counter()
        for job in jobs:
            _sleep_until(due)
            submitted[job.job_id] = self.submit(job, priority)
            due += gap_s
        return self.finish(submitted)

    def priority_under_load(
        self, backlog: list[BenchJob], high: list[BenchJob], gap_s: float, batch: int
    ) -> tuple[list[JobTrace], dict[str, object]]:
        """A low-priority backlog first; once a full batch (`batch` jobs) of it streams, high jobs spaced out.

        The backlog left when the high jobs are done is cancelled (control topic) rather than drained:
        its only purpose was to keep the worker saturated, and cancelled jobs still end with a terminal row.
        """
        low = self.submit_all(backlog, "low")
        busy = self.recorder.wait_started(list(low), min(len(low), batch), timeout_s=self.timeout_s)
        high_traces = self.spaced(high, gap_s, "high")
        unfinished = [t.job_id for t in self.recorder.traces(low) if not t.finished]
        for job_id in unfinished:
            self.client.cancel(job_id)
        try:
            self.recorder.wait_finished(unfinished, min(self.timeout_s, 60.0), self.worker)
            left = 0
        except TimeoutError:
            left = sum(1 for t in self.recorder.traces({j: 0.0 for j in unfinished}) if not t.finished)
        info = {
            "low_streaming_before_high": busy,
            "low_unfinished_when_high_done": len(unfinished),
            "low_cancelled_without_final_event": left,
            "low_per_job": per_job(self.recorder.traces(low)),
            "high_per_job": per_job(high_traces),
        }
        return high_traces, info


def summarize_poisson(rate: float, fraction: float, traces: list[JobTrace]) -> dict[str, object]:
    summary = {"rate_jobs_s": rate, "fraction_of_saturation": fraction, **latency_summary(traces)}
    return {**summary, "per_job": per_job(traces)}


def ttfts(traces: list[JobTrace]) -> list[float]:
    return [v for v in map(ttft_ms, traces) if v is not None]


def _sleep_until(due: float) -> None:
    left = due - time.perf_counter()
    if left > 0:
        time.sleep(left)
