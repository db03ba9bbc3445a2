"""Every Triton kernel of the engine compiled for the device, here, without a GPU (tests/gpu/triton_aot.py):
for sm_90 and sm_80, bf16 and fp16, at the shapes of the device check's models and docs/models.md's, by
the Triton of the GPU image (bench/device/image.py TRITON, a pinned wheel that `bash dev.sh` installs beside
the venv, whose own Triton comes with torch and is newer), within the hardware's register and shared-memory
limits, with no spills, and with no compilation that a step of another size would add mid-run.

It runs in a subprocess with the pinned Triton first on sys.path; the compiles run in parallel processes,
into a fresh cache (nothing from an earlier run can hide a kernel that no longer compiles)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.device import image as device_image

REPO = Path(__file__).resolve().parents[2]
KERNELS = REPO / "gpu" / "triton_kernels"


def _jit_kernels() -> set[str]:
    """module.function of every @triton.jit function in gpu/triton_kernels/."""
    found = set()
    for path in KERNELS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d).startswith("triton.jit") for d in node.decorator_list
            ):
                found.add(f"gpu.triton_kernels.{path.stem}.{node.name}")
    return found


@pytest.mark.slow
def test_every_triton_kernel_compiles_for_the_device_within_its_limits(tmp_path):
    pinned = device_image.pinned_triton()
    if not (pinned / "triton" / "__init__.py").exists():
        pytest.fail(
            f"the GPU image's Triton ({device_image.TRITON}) is not installed at {pinned}: run "
            f"`bash dev.sh test` or `pip install --target {pinned} --no-deps triton=={device_image.TRITON}`",
            pytrace=False,
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    env["PYTHONPATH"] = os.pathsep.join([str(pinned), str(REPO)])
    report = tmp_path / "aot.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu.triton_aot", "--json", str(report)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    print(done.stdout[-4000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["triton"] == device_image.TRITON and not result["mid_run"]
    compiled = {r["variant"].split(" ")[0] for r in result["results"]}
    assert compiled == _jit_kernels(), "a Triton kernel of the engine that the AOT check does not launch"
    targets = {r["variant"].split(" ")[1] for r in result["results"]}
    assert targets == {"sm_90", "sm_80"}
    assert all(r["registers"] and r["spill_bytes"] == 0 and not r["problems"] for r in result["results"])
