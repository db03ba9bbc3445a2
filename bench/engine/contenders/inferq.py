"""`inferq`: our engine. All requests are added at t=0, then the loop steps until none is unfinished."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from bench.engine.contenders import RunResult
from bench.machine import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from bench.workload import BenchRequest

if TYPE_CHECKING:
    from gpu.engine import Engine, EngineRequest

STATS_EVERY = 8  # steps between samples of KV usage (sampling every step would cost wall time)


def make_engine(model_path: str | None, options: dict[str, Any]) -> Engine:
    """options: EngineConfig fields, plus "device" and "dtype" (default: the CPU in float32)."""
    from gpu.engine import Engine

    return Engine.from_options(model_path, **{"dtype": "float32", "device": "cpu", **options})


def engine_requests(requests: tuple[BenchRequest, ...]) -> list[EngineRequest]:
    from gpu.engine import EngineRequest
    from scheduler.types import SamplingParams

    return [
        EngineRequest(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            sampling=SamplingParams(max_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=True),
        )
        for r in requests
    ]


class InferqContender:
    name = "inferq"

    def __init__(self, model_path: str | None, options: dict[str, Any]) -> None:
        self.model_path = model_path
        self.options = options

    def warm_up(self, requests: tuple[BenchRequest, ...]) -> None:
        self.run(requests)

    def run(self, requests: tuple[BenchRequest, ...]) -> RunResult:
        # A fresh engine per repetition: a reused one would serve later repetitions from its prefix cache.
        engine = make_engine(self.model_path, self.options)
        engine.generate(engine_requests(_warm_up_requests()))  # one-time costs of this instance, untimed
        pending = engine_requests(requests)
        before = engine.stats()
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        steps = sampled = peak_blocks = 0
        rss_before = current_rss_bytes()
        rss_reset = reset_peak_rss()

        start, cpu_start = time.perf_counter(), time.process_time()
        for request in pending:
            engine.add_request(request)
        while engine.has_unfinished():
            outputs = engine.step()
            steps += 1
            for output in outputs:
                tokens[output.request_id].extend(output.new_token_ids)
                sampled += len(output.new_token_ids)
            if steps % STATS_EVERY == 0:
                peak_blocks = max(peak_blocks, engine.stats().kv_blocks_used)
        wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start

        after = engine.stats()
        forward_s = after.forward_seconds - before.forward_seconds
        model_steps = after.steps - before.steps
        # The engine's means cover its whole life (warm-up included): turn them back into totals.
        seqs = after.mean_batch_size * after.steps - before.mean_batch_size * before.steps
        batch_tokens = after.mean_batch_tokens * after.steps - before.mean_batch_tokens * before.steps
        extras = {
            "forward_seconds": forward_s,
            "forward_fraction": forward_s / wall_s,
            "steps": float(steps),
            "mean_batch_size": seqs / model_steps if model_steps else float("nan"),  # sequences per forward
            "mean_batch_tokens": batch_tokens / model_steps if model_steps else float("nan"),
            "mean_sampled_per_step": sampled / max(steps, 1),  # tokens the steps returned
            "kv_blocks_used_peak": float(peak_blocks),
            "kv_blocks_total": float(after.kv_blocks_total),
            "preemptions": float(after.preemptions - before.preemptions),
            # process-wide: includes the other contenders' models loaded in this process
            "peak_rss_bytes": float(peak_rss_bytes()) if rss_reset else float("nan"),
            "rss_before_bytes": float(rss_before),
        }
        return RunResult(wall_s=wall_s, cpu_s=cpu_s, tokens=tokens, extras=extras)


def _warm_up_requests() -> tuple[BenchRequest, ...]:
    # Token ids unlikely to share a block-sized prefix with any workload prompt.
    return (
        BenchRequest("warm-up-0", tuple(range(3, 3 + 40)), 8),
        BenchRequest("warm-up-1", tuple(range(50, 50 + 20)), 8),
    )
