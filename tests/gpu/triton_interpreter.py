"""Importing the Triton kernels in a test module: compiled on a GPU, in triton's interpreter without one.

Triton reads TRITON_INTERPRET when first imported (its own library functions, tl.sum and the like, are
kernels too), when a kernel is decorated and when one runs. Without CUDA, tests/conftest.py sets it for
the whole session just before triton's first import, whoever imports it: a module collected earlier that
imports torch._dynamo (which imports triton) cannot leave these modules uninterpreted. `interpreting()`
keeps it set while a kernel module's tests run even if a test in between removed it.
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


@contextlib.contextmanager
def interpreting() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        if not CUDA:
            patch.setenv("TRITON_INTERPRET", "1")
        yield


def import_kernels(*names: str) -> list[ModuleType]:
    """gpu.triton_kernels.<name> for each name; the calling module skipped only where triton does not
    import (CI has it: there the skip fails the run, tests/conftest.py)."""
    if not CUDA and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported without TRITON_INTERPRET=1 on a machine without CUDA, so its kernels "
            "cannot be interpreted: tests/conftest.py sets it before triton's first import; what imported "
            "triton before the conftest did (a pytest plugin?)"
        )
    with interpreting():
        if not triton_kernels.importable():
            pytest.skip(
                "triton does not import here: the Triton kernels cannot be tested", allow_module_level=True
            )
        return [importlib.import_module(f"gpu.triton_kernels.{name}") for name in names]
