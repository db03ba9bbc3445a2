"""Host-to-device copies through pinned (page-locked) buffers, so they are truly asynchronous.

Safe by construction, whatever a step reads back: the buffers rotate over `depth` slots (double-buffered
by default), and each slot has an event recorded after the step that used it was enqueued. A step first
moves to the next slot and waits for that slot's event, so a pinned buffer is never rewritten while a copy
from it may still be queued. (A step that samples no row, such as a middle chunk of a long prompt, reads
nothing back and so does not synchronise: two such steps in a row used to rewrite one buffer under a copy
still in flight.) Without CUDA there are no events: copies from plain memory are synchronous.

Use: `begin_step()`, then any number of `to_device`/`into`/`buffer` calls, then `end_step()` once the
step's copies (and kernels) are enqueued.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class PinnedStaging:
    def __init__(
        self, device: torch.device, depth: int = 2, event_factory: Callable[[], Any] | None = None
    ) -> None:
        """event_factory: makes the per-slot events (record(), synchronize()); default torch.cuda.Event on
        CUDA, none elsewhere. Tests inject a fake one."""
        self.device = device
        self.pin = device.type == "cuda"  # pinning needs a CUDA driver; elsewhere plain buffers stand in
        if event_factory is None and self.pin:
            event_factory = torch.cuda.Event
        self._slots: list[dict[tuple[str, torch.dtype], torch.Tensor]] = [{} for _ in range(depth)]
        self._events: list[Any] = [event_factory() if event_factory else None for _ in range(depth)]
        self._recorded = [False] * depth
        self._slot = 0
        self._buffers = self._slots[0]  # the current slot's buffers

    def begin_step(self) -> None:
        """Move to the next slot and wait until the copies of the step that last used it have run."""
        self._slot = (self._slot + 1) % len(self._slots)
        self._buffers = self._slots[self._slot]
        event = self._events[self._slot]
        if event is not None and self._recorded[self._slot]:
            event.synchronize()
            self._recorded[self._slot] = False

    def end_step(self) -> None:
        """Mark the current slot's copies as enqueued (call after the step's last copy from it)."""
        event = self._events[self._slot]
        if event is not None:
            event.record()
            self._recorded[self._slot] = True

    def to_device(self, name: str, host: torch.Tensor) -> torch.Tensor:
        """A device copy of a CPU tensor, through the pinned buffer kept under `name`."""
        return self._pinned(name, host).to(self.device, non_blocking=True)

    def into(self, name: str, host: torch.Tensor, target: torch.Tensor) -> None:
        """Copy a CPU tensor into the leading rows of a device tensor (a graph's static input)."""
        target[: host.shape[0]].copy_(self._pinned(name, host), non_blocking=True)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The current slot's pinned buffer under `name` as a contiguous tensor of `shape`, to fill in place
        (its contents are whatever was last there)."""
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
