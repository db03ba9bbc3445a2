"""Loaded adapters in host memory, by (name, path), the least recently used dropped past the capacity.

Keyed by (name, path): an adapter registered again under the same name with another directory is another
entry, loaded from that directory; requests already holding the old one finish on the old weights, and the
old entry leaves like any other once no request holds it. Files changed in place inside the same directory
are not noticed while the entry stays in the cache: register a new directory to change an adapter.

An adapter some live request holds is never dropped (that request would have to read it again, and the
directory may be gone): the cache may then hold more than its capacity until those requests end.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from gpu.engine_types import LoraRequest
from gpu.lora.adapter import LoraAdapter

log = logging.getLogger(__name__)

Key = tuple[str, str]


class HostCache:
    def __init__(self, capacity: int, load: Callable[[LoraRequest], LoraAdapter]) -> None:
        if capacity < 1:
            raise ValueError("max_cpu_loras must be at least 1")
        self.capacity = capacity
        self._load = load
        self._entries: OrderedDict[Key, LoraAdapter] = OrderedDict()  # least recently used first
        self._holders: dict[Key, int] = {}  # live requests holding each adapter

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def get(self, lora: LoraRequest) -> LoraAdapter:
        """The adapter, loaded now if absent (raises LoraError); it becomes the most recently used."""
        key = (lora.name, lora.path)
        adapter = self._entries.get(key)
        if adapter is None:
            adapter = self._load(lora)
            self._entries[key] = adapter
            log.info("LoRA adapter %r loaded from %s (rank %d, %.1f MiB)", lora.name, lora.path,
                     adapter.rank, adapter.nbytes / 2**20)  # fmt: skip
        else:
            self._entries.move_to_end(key)
        self._shrink()
        return adapter

    def hold(self, lora: LoraRequest) -> LoraAdapter:
        """`get`, and keep it until `release`: a live request runs under it."""
        adapter = self.get(lora)
        self._holders[adapter.key] = self._holders.get(adapter.key, 0) + 1
        return adapter

    def release(self, key: Key) -> None:
        count = self._holders.get(key, 0) - 1
        if count > 0:
            self._holders[key] = count
            return
        self._holders.pop(key, None)
        self._shrink()

    def _shrink(self) -> None:
        if len(self._entries) <= self.capacity:
            return
        for key in [k for k in self._entries if k not in self._holders]:
            if len(self._entries) <= self.capacity:
                return
            del self._entries[key]
            log.info("LoRA adapter %r (%s) dropped from host memory", *key)
