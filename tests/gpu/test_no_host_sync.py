"""A step's sampling never waits for the device before its tokens: run on a device stand-in whose values
cannot be read (tests/gpu/no_host_sync.py), the sampler and the runner's launch of a whole step (temperature,
top-k, top-p, penalties, logit bias, logprobs, a resumed sample's forced token and recomputed logprobs)
queue their work and return; only reading the tokens would touch a device value."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from gpu.cuda.step import StepLogits
from gpu.engine import Engine, EngineRequest
from gpu.logits_processors import LogitsState, launch_logprobs
from gpu.resume import ResumeRows
from gpu.sampler import SamplingBatch, sample
from gpu.samples import stream_key
from scheduler.output import ScheduledChunk
from scheduler.types import SamplingParams
from tests.gpu.factories import greedy, make_engine, make_prompts
from tests.gpu.no_host_sync import DEVICE, HostSync, NoHostSync

VOCAB = 300
SAMPLED = SamplingParams(
    max_tokens=20,
    temperature=0.8,
    top_k=30,
    top_p=0.9,
    seed=3,
    presence_penalty=0.5,
    frequency_penalty=0.2,
    repetition_penalty=1.2,
    logit_bias=((5, 1.5), (9, -3.0)),
    logprobs=2,
)


def chunk(seq_id: str, sampling: SamplingParams, generated: int = 0) -> ScheduledChunk:
    return ScheduledChunk(seq_id, (7,), 10, (0,), True, sampling, generated)


def test_the_sampler_reads_no_device_value():
    params = [
        SAMPLED,
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=3),
    ]
    state = LogitsState(VOCAB)
    state.add("a", [1, 2, 2, 5], SAMPLED)
    plan = state.plan([chunk(str(i), p) for i, p in zip("abcd", params, strict=True)])
    assert plan is not None
    forced = ResumeRows(np.array([1]), np.array([42]), np.zeros(0, np.int64), ())
    batch = SamplingBatch.build(params, [stream_key(i, 0) for i in range(4)], [0, 3, 1, 2], VOCAB, forced)
    assert batch is not None
    logits = torch.empty(4, VOCAB, device=DEVICE)
    with NoHostSync():
        on_device, steps = batch.to(DEVICE), plan.to(DEVICE)
        tokens = sample(logits, on_device, steps)
        launch_logprobs(logits, tokens, steps)
    assert tokens.device == DEVICE and tokens.shape == (4,)


def test_the_stand_in_catches_a_read_of_the_device():
    """The check can fail: the old sampler's own reads (`bool(any())`, `int(max())`, `nonzero()`)."""
    x = torch.empty(4, device=DEVICE)
    for read in (lambda: bool((x > 0).any()), lambda: int(x.max()), lambda: x.nonzero(), lambda: x.tolist()):
        with NoHostSync(), pytest.raises((HostSync, RuntimeError, NotImplementedError)):
            read()
    with NoHostSync(), pytest.raises(HostSync, match="blocking"):
        torch.ones(3).to(DEVICE)


class MetaStep:
    """Stands in for the CUDA step: the logits of a step's rows on the meta device."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def run(self, inputs, before_forward=None) -> StepLogits:
        if before_forward is not None:
            before_forward(inputs.input_ids.to(DEVICE, non_blocking=True))
        return StepLogits(torch.empty(inputs.sample_rows.numel(), self.vocab, device=DEVICE), None)


def launch_next_step_on_meta(engine: Engine) -> None:
    """Schedule and prepare the engine's next step on the host, then launch it on the stand-in device."""
    output = engine.scheduler.schedule(time.monotonic())
    prepared = engine.runner.prepare(output, engine._seeds, None, engine._resumes, engine._logits)
    engine.runner.cuda_step = MetaStep(engine.runner.vocab_size)  # type: ignore[assignment]
    counts = engine._logits.counts
    if counts is not None and counts.counts is not None:  # made on the CPU by the steps before: moved over
        counts.counts, counts.seen = counts.counts.to(DEVICE), counts.seen.to(DEVICE)
    with NoHostSync():
        sampled = engine.runner.launch(prepared, engine._logits, engine._matchers)
    assert sampled.device.device == DEVICE and sampled.known is None  # nothing read


def requests(resume: tuple[int, ...]) -> list[EngineRequest]:
    prompts = make_prompts(4, 6, 20, seed=8)
    return [
        EngineRequest("sampled", prompts[0], SAMPLED),
        EngineRequest("plain", prompts[1], SamplingParams(max_tokens=20, temperature=1.1, top_p=0.7, seed=1)),
        EngineRequest("greedy", prompts[2], greedy(20)),
        EngineRequest("resumed", prompts[3], SAMPLED, resume=(resume,)),
    ]


@pytest.mark.parametrize("device_counts", [False, True], ids=["host-counts", "device-counts"])
@pytest.mark.parametrize("steps_before", [0, 1])
def test_a_whole_step_launches_without_reading_the_device(steps_before, device_counts):
    """The first step (prefills: a resumed sample's gathered logprobs and forced token, the others' first
    draws) and a decode step of sampled, penalised, biased and logprob rows beside greedy ones; penalty
    counts on the host (recorded once the tokens are read) or on the device (counted there)."""
    engine = make_engine()
    engine._logits = LogitsState(engine.model.config.vocab_size, device_counts, engine._seeds)
    for request in requests((40, 41, 42, 43, 44, 45)):
        engine.add_request(request)
    for _ in range(steps_before):
        engine.step()
    assert bool(engine._resumes) == (steps_before == 0)
    launch_next_step_on_meta(engine)
