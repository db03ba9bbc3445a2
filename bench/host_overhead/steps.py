"""The engine's own time per decode step, by phase, with the model's forward replaced by a stub.

What remains is the host's share of a step: scheduling, input building, sampling and turning tokens into
outputs. On CUDA that work runs while the device waits, so it bounds the step rate whatever the model.

Two workloads: every row greedy, or every row sampled (temperature, top-k, top-p, presence, frequency and
repetition penalties, seeded). Standing in for the CUDA step (`device_argmax`), the engine is set up as on
CUDA (penalty counts on the device) and the sampler's tensor work (`gpu.sampler.sample`: the device's
kernels) is left to the stand-in, as the forward is (`SamplerClock`): host time is what is left.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gpu.step_clock import FORWARD, PHASES
from scheduler.types import SamplingParams

if TYPE_CHECKING:
    from gpu.engine import Engine
    from gpu.inputs import StepInputs

MAX_PREFILL_STEPS = 10_000  # guard against an engine that never finishes prefilling


GREEDY = "greedy"
SAMPLED = "sampled"
WORKLOADS = (GREEDY, SAMPLED)


def workload_sampling(workload: str, max_tokens: int, seed: int) -> SamplingParams:
    """Every row's settings in a workload: greedy, or sampled with every filter and penalty."""
    if workload == GREEDY:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        seed=seed,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        ignore_eos=True,
    )


class StubForward:
    """Stands in for the model: logits [sampling rows, vocab] whose maximum is always `token`, for free.

    The logits are one buffer filled once and copied out (`copy`: a sampled row's penalties change its
    logits in place; not needed where the sampler does not run, beside the stand-in CUDA step), so a step
    costs the engine's host work and the sampler's work over the vocabulary, and nothing else.
    """

    def __init__(self, vocab_size: int, token: int, rows: int, copy: bool = True) -> None:
        self.vocab_size, self.token, self.copy = vocab_size, token, copy
        self._logits = self._fill(rows)
        self.calls = 0

    def _fill(self, rows: int) -> torch.Tensor:
        logits = torch.zeros(rows, self.vocab_size)
        logits[:, self.token] = 1.0
        return logits

    def __call__(self, inputs: StepInputs, cache: Any, attention: Any, lora: Any = None) -> torch.Tensor:
        self.calls += 1
        rows = int(inputs.sample_rows.numel())
        if rows > len(self._logits):
            self._logits = self._fill(rows)
        return self._logits[:rows].clone() if self.copy else self._logits[:rows]


class StubDeviceStep:
    """Stands in for the CUDA step (gpu/cuda/step.py): the stub's logits with each row's argmax computed
    "on the device", as the decode graph returns it, so the sampler takes those ids and the host does
    exactly what it does around a graph step (the argmax itself is the device's, not timed here)."""

    def __init__(self, stub: StubForward, block_size: int) -> None:
        self.stub, self.block_size = stub, block_size
        self._greedy = torch.full((len(stub._logits),), stub.token, dtype=torch.int64)
        # Block table bytes the steps would send the device: their updates (index and value, int64), and
        # what a step's own rows up to its widest context come to (the per-step table sent before them)
        self.update_bytes = self.rows_bytes = 0

    def run(self, inputs: StepInputs, before_forward: Any = None, lora: Any = None) -> Any:
        from gpu.cuda.step import StepLogits

        meta = inputs.attention
        if inputs.table_updates is not None:
            self.update_bytes += 16 * len(inputs.table_updates.index)
            self.rows_bytes += 8 * meta.num_decodes * -(-meta.max_decode_len // self.block_size)
        if before_forward is not None:  # placeholders filled "on the device", as the CUDA step does
            before_forward(inputs.input_ids)
        logits = self.stub(inputs, None, None)
        if len(logits) > len(self._greedy):
            self._greedy = torch.full((len(logits),), self.stub.token, dtype=torch.int64)
        return StepLogits(logits, self._greedy[: len(logits)])


class SamplerClock:
    """Times the sampler's tensor work (gpu.runner's `sample`). `device`: the stub stands in for the CUDA
    step, so that work is the device's, as the forward and the argmax are: it is not run, the step's tokens
    are the stub's token (greedy rows: the argmax the stub returned), and the host's time is what is left
    (the sampler's operations, each a kernel launch on CUDA, are counted apart: `sampler_ops`)."""

    def __init__(self, token: int | None = None) -> None:
        self.seconds = 0.0
        self.calls = 0
        import gpu.runner

        self._module = gpu.runner
        self._sample = sample = gpu.runner.sample

        def timed(logits: torch.Tensor, batch: Any, plan: Any = None, greedy: Any = None) -> torch.Tensor:
            start = time.perf_counter()
            try:
                with torch.profiler.record_function(SAMPLE_RANGE):
                    if token is None:
                        return sample(logits, batch, plan, greedy)
                    if batch is None and greedy is not None:
                        return greedy  # what the sampler returns for greedy rows beside a CUDA graph
                    return torch.full((len(logits),), token, dtype=torch.int64)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        gpu.runner.sample = timed  # type: ignore[assignment]

    def close(self) -> None:
        self._module.sample = self._sample  # type: ignore[assignment]


SAMPLE_RANGE = "inferq.sample"


def sampler_ops(engine: Engine, batch: int) -> int:
    """The tensor operations the sampler issues in one decode step (each a kernel launch, at least, on
    CUDA: host time the measured host work leaves out), counted by the profiler in a step of its own."""
    sampler = SamplerClock()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _decode_step(engine, batch)
    finally:
        sampler.close()
    ranges = [e for e in prof.events() if e.name == SAMPLE_RANGE]
    return sum(len([c for c in e.cpu_children if c.name.startswith("aten::")]) for e in ranges)


@dataclass(frozen=True)
class HostSteps:
    """Decode steps of one workload and batch size: medians over repetitions of `steps` steps each."""

    workload: str
    batch: int
    step_ms: float  # wall time of engine.step() (and the bench's check of its outputs)
    host_ms: float  # inside engine.step(), the stub forward left out (async: the wait for the worker)
    # CPU time of the thread calling engine.step() (the engine thread), the bench's checks included: what
    # that thread itself holds, waits for the worker or the GIL and other processes' turns left out
    engine_cpu_ms: float
    phases_ms: dict[str, float]  # per phase of gpu/step_clock.py
    sampler_ms: float  # the sampler's tensor work per step (in `sample`: device work beside a CUDA step)
    sampler_ops: int  # the tensor operations it issues in a step (kernel launches on CUDA)
    argmax_ms: float  # the sampler's argmax over the stub logits alone (device work on CUDA)
    decode_steps: int  # steps measured
    tokens: int  # tokens those steps returned (batch per step)
    # --device-argmax: block table bytes per step sent to the device (its updates), and the step's rows
    table_update_bytes: float = 0.0
    table_rows_bytes: float = 0.0
    host_reps: tuple[float, ...] = ()  # host_ms of each repetition, in order (paired across workloads)


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
    stub = StubForward(engine.model.config.vocab_size, token, max_num_seqs, copy=not device_argmax)
    engine.runner.forward = stub  # type: ignore[assignment]
    if device_argmax:
        from gpu.logits_processors import LogitsState

        engine.runner.cuda_step = StubDeviceStep(stub, engine.config.block_size)  # type: ignore[assignment]
        engine.runner.inputs.device_tables = True  # as on CUDA: each step logs its block-table updates
        # as on CUDA: penalty counts on the "device" (gpu/penalty_counts.py), counted there
        engine._logits = LogitsState(engine.model.config.vocab_size, True, engine._seeds)
    return engine, stub


class HostRun:
    """One workload at one batch size on its own engine: `batch` requests started and prefilled, then timed
    a repetition of `steps` decode steps at a time (`rep`), so that the workloads' repetitions can take turns
    (a noisy machine's slow spells then fall on each of them alike); `finish` ends them and gives the
    medians. `device_argmax`: the stub stands in for the CUDA step, so the sampler's tensor work is the
    device's and is left out of the host's time (it is reported apart either way)."""

    def __init__(
        self,
        engine: Engine,
        batch: int,
        prompt_len: int,
        warmup: int,
        seed: int = 0,
        workload: str = GREEDY,
        device_argmax: bool = False,
    ) -> None:
        from gpu.engine import EngineRequest

        self.engine, self.batch, self.workload, self.device_argmax = engine, batch, workload, device_argmax
        rng = random.Random(seed * 1_000_003 + batch)
        # As long as the context allows: no row may finish while it is timed (_decode_step checks).
        max_tokens = engine.scheduler.config.max_model_len - prompt_len
        self.ids = [f"host-{workload}-{batch}-{i}" for i in range(batch)]
        for i, request_id in enumerate(self.ids):
            prompt = tuple(rng.randrange(3, 259) for _ in range(prompt_len))  # random: no prefix-cache hits
            engine.add_request(EngineRequest(request_id, prompt, workload_sampling(workload, max_tokens, i)))
        _until_all_decode(engine, set(self.ids))
        for _ in range(warmup):
            _decode_step(engine, batch)
        self.ops = sampler_ops(engine, batch)
        self.step_ms: list[float] = []
        self.cpu_ms: list[float] = []
        self.phase_ms: list[dict[str, float]] = []
        self.sampler_ms: list[float] = []
        self.steps = self.tokens = 0
        self.table_bytes = [0, 0]  # updates, rows: over the steps timed

    def rep(self, steps: int) -> None:
        """Time `steps` decode steps."""
        engine = self.engine
        sampler = SamplerClock(engine.runner.forward.token if self.device_argmax else None)
        device = engine.runner.cuda_step if self.device_argmax else None
        sent = (device.update_bytes, device.rows_bytes) if device is not None else (0, 0)
        try:
            before = engine.clock.snapshot()
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                self.tokens += _decode_step(engine, self.batch)
            self.step_ms.append((time.perf_counter() - start) / steps * 1000)
            self.cpu_ms.append((time.thread_time() - cpu) / steps * 1000)
            after = engine.clock.snapshot()
            self.phase_ms.append({p: (after[p] - before[p]) / steps * 1000 for p in PHASES})
            self.sampler_ms.append(sampler.seconds / steps * 1000)
            self.steps += steps
            if device is not None:
                self.table_bytes[0] += device.update_bytes - sent[0]
                self.table_bytes[1] += device.rows_bytes - sent[1]
        finally:
            sampler.close()

    def finish(self) -> HostSteps:
        """End the requests; the medians of the repetitions timed."""
        for request_id in self.ids:
            self.engine.abort_request(request_id)
        phases = {p: statistics.median(r[p] for r in self.phase_ms) for p in PHASES}
        # the stand-in's own instant, left out too
        device = self.sampler_ms if self.device_argmax else [0.0] * len(self.phase_ms)
        reps = zip(self.phase_ms, device, strict=True)
        host_reps = tuple(sum(r.values()) - r[FORWARD] - d for r, d in reps)
        host = statistics.median(host_reps)
        return HostSteps(
            workload=self.workload,
            batch=self.batch,
            step_ms=statistics.median(self.step_ms),
            host_ms=host,
            engine_cpu_ms=statistics.median(self.cpu_ms),
            phases_ms=phases,
            sampler_ms=statistics.median(self.sampler_ms),
            sampler_ops=self.ops,
            argmax_ms=_argmax_ms(self.engine, self.batch),
            decode_steps=self.steps,
            tokens=self.tokens,
            table_update_bytes=self.table_bytes[0] / max(self.steps, 1),
            table_rows_bytes=self.table_bytes[1] / max(self.steps, 1),
            host_reps=host_reps,
        )


def measure_side_by_side(
    engines: dict[str, Engine],
    batch: int,
    prompt_len: int,
    steps: int,
    reps: int,
    warmup: int,
    seed: int = 0,
    device_argmax: bool = False,
) -> dict[str, HostSteps]:
    """Each workload on its engine, their repetitions taking turns (the order flipped every round), so a
    difference between them is not one spell of a noisy machine."""
    runs = [HostRun(e, batch, prompt_len, warmup, seed, w, device_argmax) for w, e in engines.items()]
    for rep in range(reps):
        for run in runs if rep % 2 == 0 else runs[::-1]:
            run.rep(steps)
    return {run.workload: run.finish() for run in runs}


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
