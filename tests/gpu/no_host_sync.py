"""A device stand-in on the CPU for checking that code never waits for the device it queues work on.

Tensors on the `meta` device have shapes and no values: any read of one (`.item()`, `bool()`, `.tolist()`,
`nonzero()`, a copy back to the host) raises. `NoHostSync` also fails every copy between the host and
another device that is not `non_blocking`, and `torch.tensor(..., device=...)` off the CPU (on CUDA,
either waits for the stream: for the step's forward). So code that runs under it on meta tensors queues its
device work without ever waiting for it. (The copies are checked where Python calls them, `Tensor.to`,
`Tensor.copy_` and `torch.tensor`, so inference mode, which the runner's step runs in, hides nothing.)
"""

from __future__ import annotations

from typing import Any

import torch

DEVICE = torch.device("meta")


class HostSync(AssertionError):
    """The code under check waited for the device (or would have, on CUDA)."""


def _device_of(args: tuple, kwargs: dict) -> tuple[torch.device | None, bool]:
    """The target device and non_blocking of a `Tensor.to` call."""
    device, non_blocking = kwargs.get("device"), kwargs.get("non_blocking", False)
    for arg in args:
        if isinstance(arg, torch.Tensor):
            device = arg.device
        elif isinstance(arg, torch.device | str):
            device = arg
        elif isinstance(arg, bool):
            non_blocking = arg
    return (None if device is None else torch.device(device)), non_blocking


class NoHostSync:
    """Raises HostSync on a blocking copy between the host and a device, or a read of a device value."""

    def __enter__(self) -> NoHostSync:
        self._saved = (torch.Tensor.to, torch.Tensor.copy_, torch.tensor)
        to, copy_, tensor = self._saved

        def checked_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            device, non_blocking = _device_of(args, kwargs)
            if device is not None and device.type != self.device.type:
                if self.device == DEVICE:
                    raise HostSync("a copy of a device tensor to the host")
                if not non_blocking:
                    raise HostSync(f"a blocking copy {self.device} -> {device}")
            return to(self, *args, **kwargs)

        def checked_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            if src.device.type != self.device.type:
                if src.device == DEVICE:
                    raise HostSync("a copy of a device tensor to the host")
                if not non_blocking:
                    raise HostSync(f"a blocking copy {src.device} -> {self.device}")
            return copy_(self, src, non_blocking)

        def checked_tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                raise HostSync(f"torch.tensor(..., device={device}): a blocking copy from the host")
            return tensor(data, *args, **kwargs)

        torch.Tensor.to = checked_to  # type: ignore[method-assign]
        torch.Tensor.copy_ = checked_copy  # type: ignore[method-assign,assignment]
        torch.tensor = checked_tensor  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.to, torch.Tensor.copy_, torch.tensor = self._saved  # type: ignore[method-assign]
