"""Host-to-device copies through pinned (page-locked) buffers, so they are truly asynchronous.

A buffer is reused on the next step: safe because every step ends by reading its sampled tokens back
to the host, which waits for all work queued before it, these copies included. With async scheduling
(gpu/engine.py) that still holds: the engine's one worker thread stages, runs and reads back each step in
turn, while the engine thread only builds the next step's inputs on the host (its own block-table copy).
"""

from __future__ import annotations

import torch


class PinnedStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"  # pinning needs a CUDA driver; elsewhere plain buffers stand in
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def to_device(self, name: str, host: torch.Tensor) -> torch.Tensor:
        """A device copy of a CPU tensor, through the pinned buffer kept under `name`."""
        return self._pinned(name, host).to(self.device, non_blocking=True)

    def into(self, name: str, host: torch.Tensor, target: torch.Tensor) -> None:
        """Copy a CPU tensor into the leading rows of a device tensor (a graph's static input)."""
        target[: host.shape[0]].copy_(self._pinned(name, host), non_blocking=True)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The pinned buffer under `name` as a contiguous tensor of `shape`, to fill in place (its
        contents are whatever was last there)."""
        numel = 1
        for n in shape:
            numel *= n
        key = (name, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            size = max(numel, 2 * buffer.numel() if buffer is not None else 1)
            buffer = self._buffers[key] = torch.empty(size, dtype=dtype, pin_memory=self.pin)
        return buffer[:numel].view(shape)

    def _pinned(self, name: str, host: torch.Tensor) -> torch.Tensor:
        staged = self.buffer(name, tuple(host.shape), host.dtype)
        staged.copy_(host)
        return staged
