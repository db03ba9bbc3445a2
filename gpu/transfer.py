"""Small host arrays to the device in one copy that never blocks the host.

A step's sampling settings (gpu/sampler.py) and bias and penalty pairs (gpu/logits_processors.py) are built
on the host while the step is prepared. A plain `.to(device)` of a pageable tensor waits for the copy, and so
for everything queued on the stream before it: the step's forward. Here the arrays are packed into one
pinned buffer, copied with non_blocking=True, and the device tensors are views of the one device buffer.
PyTorch's pinned allocator keeps a buffer from reuse until the copies from it have run (it records an event
on the stream), so the host may drop its reference at once. On the CPU the arrays are used in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypeVar

import numpy as np
import torch

_ALIGN = 8  # every array starts on an 8-byte boundary, so each view of the buffer is aligned for its dtype


def to_device(arrays: Mapping[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """The arrays as tensors on `device`: on the CPU the arrays themselves; elsewhere views of one buffer
    copied there without blocking (from pinned memory on CUDA)."""
    if device.type == "cpu":
        return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
    places = {}
    size = 0
    for name, a in arrays.items():
        places[name] = size
        size += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(size, _ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
    packed = host.numpy()
    for name, a in arrays.items():
        packed[places[name] : places[name] + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    on_device = host.to(device, non_blocking=True)
    return {
        name: on_device[places[name] : places[name] + a.nbytes].view(_DTYPES[a.dtype]).view(a.shape)
        for name, a in arrays.items()
    }


T = TypeVar("T")


def tensors_to(value: T, device: torch.device) -> T:
    """A frozen dataclass whose CPU tensor fields are moved to `device` together, as `to_device` moves them
    (the same object on the CPU)."""
    if device.type == "cpu":
        return value
    fields = {
        f.name: getattr(value, f.name)
        for f in dataclasses.fields(value)  # type: ignore[arg-type]
        if isinstance(getattr(value, f.name), torch.Tensor)
    }
    moved = to_device({name: t.numpy() for name, t in fields.items()}, device)
    return dataclasses.replace(value, **moved)  # type: ignore[type-var]


_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.bool_): torch.bool,
}
