"""Importing the Triton kernels in a test module: compiled on a GPU, in triton's interpreter without one.

TRITON_INTERPRET=1 is set only while the kernel modules are imported and while that module's tests run
(`interpreting()`): triton reads it when first imported (its own library functions, tl.sum and the like,
are kernels too), when a kernel is decorated and when one runs. Other test modules never see it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from gpu import triton_kernels

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
_first_imported_here = False  # triton was first imported by import_kernels, under the interpreter


@contextlib.contextmanager
def interpreting() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        if not CUDA:
            patch.setenv("TRITON_INTERPRET", "1")
        yield


def import_kernels(*names: str) -> list[ModuleType]:
    """gpu.triton_kernels.<name> for each name, or the calling module skipped where they cannot run."""
    # Imported earlier in this process without the interpreter (nothing in the repo does): cannot interpret.
    # Another test module importing it here first, under the interpreter, is fine.
    global _first_imported_here
    imported = "triton" in sys.modules
    interpreted = _first_imported_here or os.environ.get("TRITON_INTERPRET") == "1"
    too_late = not CUDA and imported and not interpreted
    with interpreting():
        if not triton_kernels.importable():
            pytest.skip(
                "triton does not import here: the Triton kernels cannot be tested", allow_module_level=True
            )
        if too_late:
            pytest.skip(
                "triton was imported before this module could turn on its interpreter: run this file on "
                "its own or with TRITON_INTERPRET=1",
                allow_module_level=True,
            )
        modules = [importlib.import_module(f"gpu.triton_kernels.{name}") for name in names]
        _first_imported_here = _first_imported_here or not imported
        return modules
