"""LoRA adapters in the scheduler: which adapters hold the engine's `max_loras` slots, and which one drains.

An adapter holds a slot while any of its sequences runs. When a waiting sequence's adapter finds every slot
taken, one running adapter is chosen to drain: it takes no new sequences, so it leaves once its running ones
end, and the waiting sequence takes its slot (Scheduler._admit_waiting looks past both meanwhile).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class AdapterSlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.running: dict[str, int] = {}  # running sequences per adapter
        self.draining: str | None = None  # takes no new sequences while another waits for a slot

    def needs_slot(self, lora: str | None) -> bool:
        """The adapter is not running and every slot is taken."""
        return lora is not None and lora not in self.running and len(self.running) >= self.max_loras

    def enter(self, lora: str | None) -> None:
        """A sequence under `lora` (None: the base model) starts running."""
        if lora is not None:
            self.running[lora] = self.running.get(lora, 0) + 1

    def leave(self, lora: str | None) -> None:
        """A sequence under `lora` stops running; its adapter's slot frees with its last sequence."""
        if lora is None:
            return
        left = self.running[lora] - 1
        if left:
            self.running[lora] = left
            return
        del self.running[lora]
        if self.draining == lora:
            self.draining = None

    def drain_one(self, waiting: Iterable[str | None]) -> None:
        """Choose the running adapter whose leaving holds back the least work: the fewest sequences waiting
        for it (`waiting`: the waiting sequences' adapters; none: draining it delays nobody), then the
        fewest running (it leaves soonest)."""
        waits = Counter(lora for lora in waiting if lora in self.running)
        self.draining = min(self.running, key=lambda lora: (waits[lora], self.running[lora], lora))
