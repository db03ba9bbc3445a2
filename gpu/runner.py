"""One step on the model: SchedulerOutput in, one sampled token per sampling sequence out."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

import torch

from gpu.forward import LlamaForward
from gpu.inputs import StepInputs, build_inputs
from gpu.kv_cache import KVCache
from gpu.model import LoadedModel
from gpu.sampler import sample
from gpu.threads import ThreadTuner
from scheduler.output import SchedulerOutput

LM_HEAD_WEIGHT = 3


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, block_size: int, max_model_len: int, num_blocks: int | None, kv_bytes: int
    ) -> None:
        """num_blocks sizes the KV cache when given; otherwise it is as many blocks as fit in kv_bytes."""
        self.block_size = block_size
        self.device, self.dtype = loaded.device, loaded.dtype
        self.forward = LlamaForward(loaded, max_positions=max_model_len)
        shape = self.forward.kv_shape(block_size)
        self.cache = KVCache(shape, num_blocks or shape.blocks_for_budget(kv_bytes), loaded.device)
        self.threads = ThreadTuner() if loaded.device.type == "cpu" else None

    def _inputs(self, output: SchedulerOutput) -> StepInputs:
        inputs = build_inputs(output, self.block_size, self.dtype)
        if self.device.type == "cpu":
            return inputs
        return to_device(inputs, self.device)

    def execute(self, output: SchedulerOutput, seeds: Mapping[str, int]) -> dict[str, int]:
        """Run every scheduled token through the model and sample for the chunks that ask for it."""
        if self.threads is None:
            return self._execute(output, seeds)
        self.threads.before_step()
        start = time.perf_counter()
        try:
            return self._execute(output, seeds)
        finally:
            # A sampled row also runs the output projection, about 3x a token's other work here.
            work = output.num_tokens + LM_HEAD_WEIGHT * sum(c.sample for c in output.chunks)
            self.threads.after_step(time.perf_counter() - start, work)

    @torch.inference_mode()
    def _execute(self, output: SchedulerOutput, seeds: Mapping[str, int]) -> dict[str, int]:
        inputs = self._inputs(output)
        logits = self.forward(inputs, self.cache)
        chunks = inputs.sample_chunks
        tokens = sample(
            logits,
            [c.sampling for c in chunks],
            [seeds.get(c.seq_id, 0) for c in chunks],
            [c.num_generated for c in chunks],
        )
        return {c.seq_id: t for c, t in zip(chunks, tokens, strict=True)}


def to_device(inputs: StepInputs, device: torch.device) -> StepInputs:
    """Move every tensor of the step's inputs (built on the CPU) to the model's device."""

    def move(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(
                value, **{f.name: move(getattr(value, f.name)) for f in dataclasses.fields(value)}
            )
        if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            return tuple(move(v) for v in value)
        return value

    return move(inputs)  # type: ignore[return-value]
