"""The engine's own time per decode step, by phase, with the model's forward replaced by a stub.

What remains is the host's share of a step: scheduling, input building, sampling and turning tokens into
outputs. On CUDA that work runs while the device waits, so it bounds the step rate whatever the model.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gpu.step_clock import FORWARD, PHASES

if TYPE_CHECKING:
    from gpu.engine import Engine
    from gpu.inputs import StepInputs

MAX_PREFILL_STEPS = 10_000  # guard against an engine that never finishes prefilling


class StubForward:
    """Stands in for the model: logits [sampling rows, vocab] whose maximum is always `token`, for free.

    The logits are one buffer filled once, so a step costs the engine's host work and the sampler's
    argmax over the vocabulary, and nothing else.
    """

    def __init__(self, vocab_size: int, token: int, rows: int) -> None:
        self.vocab_size, self.token = vocab_size, token
        self._logits = self._fill(rows)
        self.calls = 0

    def _fill(self, rows: int) -> torch.Tensor:
        logits = torch.zeros(rows, self.vocab_size)
        logits[:, self.token] = 1.0
        return logits

    def __call__(self, inputs: StepInputs, cache: Any, attention: Any) -> torch.Tensor:
        self.calls += 1
        rows = int(inputs.sample_rows.numel())
        if rows > len(self._logits):
            self._logits = self._fill(rows)
        return self._logits[:rows]


class StubDeviceStep:
    """Stands in for the CUDA step (gpu/cuda/step.py): the stub's logits with each row's argmax computed
    "on the device", as the decode graph returns it, so the sampler takes those ids and the host does
    exactly what it does around a graph step (the argmax itself is the device's, not timed here)."""

    def __init__(self, stub: StubForward) -> None:
        self.stub = stub
        self._greedy = torch.full((len(stub._logits),), stub.token, dtype=torch.int64)

    def run(self, inputs: StepInputs, before_forward: Any = None) -> Any:
        from gpu.cuda.step import StepLogits

        if before_forward is not None:  # placeholders filled "on the device", as the CUDA step does
            before_forward(inputs.input_ids)
        logits = self.stub(inputs, None, None)
        if len(logits) > len(self._greedy):
            self._greedy = torch.full((len(logits),), self.stub.token, dtype=torch.int64)
        return StepLogits(logits, self._greedy[: len(logits)])


@dataclass(frozen=True)
class HostSteps:
    """Decode steps of one batch size: medians over repetitions of `steps` steps each."""

    batch: int
    step_ms: float  # wall time of engine.step() (and the bench's check of its outputs)
    host_ms: float  # inside engine.step(), the stub forward left out (async: the wait for the worker)
    # CPU time of the thread calling engine.step() (the engine thread), the bench's checks included: what
    # that thread itself holds, waits for the worker or the GIL and other processes' turns left out
    engine_cpu_ms: float
    phases_ms: dict[str, float]  # per phase of gpu/step_clock.py
    argmax_ms: float  # the sampler's argmax over the stub logits alone (device work on CUDA)
    decode_steps: int  # steps measured
    tokens: int  # tokens those steps returned (batch per step)


def stub_engine(
    model: str,
    max_num_seqs: int,
    max_context: int,
    async_scheduling: bool = False,
    device_argmax: bool = False,
) -> tuple[Engine, StubForward]:
    """The engine on `model` with its forward stubbed; start-up measurements off (nothing runs the model).
    async_scheduling: the forward and sampling run on the engine's worker thread, the host work here.
    device_argmax: the stub stands in for the CUDA step, argmax included (see StubDeviceStep)."""
    from gpu.engine import Engine

    engine = Engine.from_options(
        model,
        dtype="float32",
        device="cpu",
        max_num_seqs=max_num_seqs,
        num_blocks=max_num_seqs * -(-max_context // 16),  # the stub never touches the pages
        max_model_len=max_context,
        decode_kernel="torch",
        fused_rope=False,
        tune_linears=False,
        async_scheduling=async_scheduling,
    )
    token = engine.tokenizer.encode("a")[-1]  # a printable character: the detokenizer does real work
    if token in engine.eos_token_ids:
        raise ValueError(f"stub token {token} is an EOS token of {model}")
    stub = StubForward(engine.model.config.vocab_size, token, max_num_seqs)
    engine.runner.forward = stub  # type: ignore[assignment]
    if device_argmax:
        engine.runner.cuda_step = StubDeviceStep(stub)  # type: ignore[assignment]
    return engine, stub


def measure_host_steps(
    engine: Engine, batch: int, prompt_len: int, steps: int, reps: int, warmup: int, seed: int = 0
) -> HostSteps:
    """Start `batch` requests, prefill them all, then time `reps` runs of `steps` decode steps each."""
    from gpu.engine import EngineRequest
    from scheduler.types import SamplingParams

    rng = random.Random(seed * 1_000_003 + batch)
    # As long as the context allows: no row may finish while it is timed (_decode_step checks).
    max_tokens = engine.scheduler.config.max_model_len - prompt_len
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [f"host-{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        prompt = tuple(rng.randrange(3, 259) for _ in range(prompt_len))  # random: no prefix-cache hits
        engine.add_request(EngineRequest(request_id, prompt, sampling))
    _until_all_decode(engine, set(ids))
    for _ in range(warmup):
        _decode_step(engine, batch)
    step_ms, cpu_ms, phase_ms, tokens = [], [], [], 0
    for _ in range(reps):
        before = engine.clock.snapshot()
        start, cpu = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            tokens += _decode_step(engine, batch)
        step_ms.append((time.perf_counter() - start) / steps * 1000)
        cpu_ms.append((time.thread_time() - cpu) / steps * 1000)
        after = engine.clock.snapshot()
        phase_ms.append({p: (after[p] - before[p]) / steps * 1000 for p in PHASES})
    for request_id in ids:
        engine.abort_request(request_id)
    phases = {p: statistics.median(r[p] for r in phase_ms) for p in PHASES}
    host = statistics.median(sum(r.values()) - r[FORWARD] for r in phase_ms)
    return HostSteps(
        batch=batch,
        step_ms=statistics.median(step_ms),
        host_ms=host,
        engine_cpu_ms=statistics.median(cpu_ms),
        phases_ms=phases,
        argmax_ms=_argmax_ms(engine, batch),
        decode_steps=steps * reps,
        tokens=tokens,
    )


def _until_all_decode(engine: Engine, ids: set[str]) -> None:
    started: set[str] = set()
    for _ in range(MAX_PREFILL_STEPS):
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
        if started >= ids:
            return
    raise RuntimeError("host steps: prefill did not finish")


def _decode_step(engine: Engine, batch: int) -> int:
    """One step that must decode every row; the tokens it returned."""
    outputs = engine.step()
    if len(outputs) != batch or any(len(o.new_token_ids) != 1 or o.finish_reason for o in outputs):
        raise RuntimeError(f"host steps: a step of batch {batch} did not decode one token per row")
    return len(outputs)


def _argmax_ms(engine: Engine, batch: int, runs: int = 20) -> float:
    from gpu.sampler import fast_argmax

    logits = torch.zeros(batch, engine.model.config.vocab_size)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fast_argmax(logits)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000
