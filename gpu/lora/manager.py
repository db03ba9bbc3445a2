"""The engine's LoRA adapters: loaded into host memory, held by the live requests that run under them, and
applied each step to the rows that use them.

On the CPU the host copy is what the forward reads (CpuLora: two matmuls per adapter and product). On CUDA
max_loras adapters are resident in stacked device slots (gpu/lora/slots.py), the least recently used taken
over between steps, and the Triton shrink/expand kernels apply them (inside the decode graphs too).

The scheduler knows an adapter by `lora_id(request)`: one string per (name, path), so an adapter
registered again with another directory is another adapter to it as well (its own prefix-cache keys).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from gpu.engine_types import LoraRequest
from gpu.lora.adapter import LoraAdapter, LoraError, load_adapter, model_targets
from gpu.lora.host_cache import HostCache
from gpu.lora.native import NativeLora, adapter_table
from gpu.lora.rows import CpuLora, LoraRows, lora_rows
from gpu.lora.slots import SlotLora, StackedSlots
from scheduler.output import SchedulerOutput


def lora_id(lora: LoraRequest) -> str:
    """The scheduler's name for an adapter: its served name and its directory."""
    return f"{lora.name}@{lora.path}"


def default_max_cpu_loras(max_loras: int) -> int:
    """Adapters kept in host memory when not told: four times the device slots, at least 16 (a few MiB to
    a few hundred each; reading one again from a shared volume costs far more than keeping it)."""
    return max(4 * max_loras, 16)


class LoraManager:
    def __init__(
        self,
        loaded: Any,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int | None = None,
        stacked: bool | None = None,
    ) -> None:
        """`stacked`: apply through device slots and the kernels' layout (None: on CUDA only; tests set it
        on the CPU, where the torch reference stands in for the kernels)."""
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        self.targets = model_targets(loaded)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype, self.device = loaded.dtype, loaded.device
        cuda = self.device.type == "cuda"
        capacity = max_cpu_loras if max_cpu_loras is not None else default_max_cpu_loras(max_loras)
        self.host = HostCache(capacity, self._load)
        self.slots: StackedSlots | None = None
        if stacked if stacked is not None else cuda:
            self.slots = StackedSlots(self.targets, max_loras, max_rank, self.dtype, self.device)
        # CPU, float32: the C kernel (None: the torch path, two matmuls per adapter and product)
        self.native = None
        if self.slots is None and NativeLora.supports(self.dtype, self.device):
            self.native = NativeLora.load()
        self._held: dict[str, LoraAdapter] = {}  # lora_id -> the adapter live requests run under
        self._holds: dict[str, int] = {}

    def _load(self, lora: LoraRequest) -> LoraAdapter:
        pin = self.device.type == "cuda"
        adapter = load_adapter(lora, self.targets, self.max_rank, self.dtype, pin)
        if self.native is not None:
            adapter = dataclasses.replace(adapter, table=adapter_table(adapter, self.targets))
        return adapter

    def load(self, lora: LoraRequest) -> LoraAdapter:
        """Into the host cache now (raises LoraError naming the adapter and the cause)."""
        return self.host.get(lora)

    def hold(self, lora: LoraRequest) -> str:
        """A live sequence runs under `lora` (loaded now if needed; raises LoraError): its lora_id."""
        key = lora_id(lora)
        adapter = self.host.hold(lora)
        self._held[key] = adapter
        self._holds[key] = self._holds.get(key, 0) + 1
        return key

    def release(self, key: str) -> None:
        """A sequence that held `key` ended."""
        count = self._holds.get(key, 0) - 1
        if count < 0:
            return
        adapter = self._held[key]
        if count:
            self._holds[key] = count
        else:
            del self._holds[key], self._held[key]
        self.host.release(adapter.key)

    @property
    def active(self) -> bool:
        """Some live sequence runs under an adapter (else a step needs no LoRA work at all)."""
        return bool(self._held)

    def rows(self, output: SchedulerOutput) -> LoraRows | None:
        """The step's adapter rows (None: every row is the base model's)."""
        held, chunks = self._held, output.chunks
        adapters = [held[c.lora] if c.lora is not None else None for c in chunks]
        lengths = None if output.num_decodes == len(chunks) else [len(c.token_ids) for c in chunks]
        return lora_rows(adapters, lengths)

    def assign(self, rows: LoraRows) -> np.ndarray:
        """Device slots for the step's adapters (copied in as needed): its `meta` vector."""
        assert self.slots is not None
        return self.slots.assign(rows)

    def host_step(self, rows: LoraRows) -> Any:
        """The step's LoRA on the CPU: the host copies, or (stacked) the slots with the torch reference."""
        if self.slots is None:
            return CpuLora(rows, self.native)
        meta = torch.from_numpy(self.assign(rows))
        return SlotLora(self.slots, meta, len(rows.rows), kernels=False)


__all__ = ["LoraError", "LoraManager", "default_max_cpu_loras", "lora_id"]
