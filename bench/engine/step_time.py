"""Step time of the inferq engine at fixed decode batch sizes (all decoding, ~130-210 tokens of context)."""

from __future__ import annotations

import random
import statistics
import time
from typing import TYPE_CHECKING, Any

from bench.engine.contenders.inferq import engine_requests, make_engine
from bench.workload import BenchRequest

if TYPE_CHECKING:
    from gpu.engine import Engine

PROMPT_LEN = 128
MAX_PREFILL_STEPS = 200  # guard against an engine that never finishes prefilling


def measure_step_times(
    model_path: str | None,
    options: dict[str, Any],
    vocab_size: int,
    batch_sizes: tuple[int, ...] = (16, 32, 64),
    steps: int = 64,
) -> dict[str, dict[str, float]]:
    """Median wall time of a decode step, and the mean time inside the engine's forward, per batch size."""
    engine = make_engine(
        model_path, {**options, "max_num_seqs": max(max(batch_sizes), options.get("max_num_seqs", 0))}
    )
    rng = random.Random(1234)
    results = {}
    for batch in batch_sizes:
        # Long enough to outlive the measurement: early starters decode while the others prefill.
        max_new = steps + MAX_PREFILL_STEPS
        requests = tuple(
            BenchRequest(
                f"step-{batch}-{i}", tuple(rng.randrange(vocab_size) for _ in range(PROMPT_LEN)), max_new
            )
            for i in range(batch)
        )
        results[str(batch)] = _measure(engine, requests, steps)
    return results


def _measure(engine: Engine, requests: tuple[BenchRequest, ...], steps: int) -> dict[str, float]:
    for request in engine_requests(requests):
        engine.add_request(request)
    started: set[str] = set()
    for _ in range(MAX_PREFILL_STEPS):  # until every sequence has its first token: all of them now decode
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
        if len(started) == len(requests):
            break
    else:
        raise RuntimeError("step time: prefill did not finish")
    times = []
    forward_before = engine.stats().forward_seconds
    for _ in range(steps):
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        if sum(1 for o in outputs if o.new_token_ids) != len(requests):
            raise RuntimeError(f"step time: batch of {len(requests)} did not decode together")
    forward_s = engine.stats().forward_seconds - forward_before
    for request in requests:
        engine.abort_request(request.request_id)
    step_s = statistics.median(times)
    return {
        "step_ms": step_s * 1000,
        "forward_ms": forward_s / steps * 1000,
        "decode_tok_s": len(requests) / step_s,
    }
