"""bench/device_check.sh's test phase under the GPU image's packages, here in CI: every file of the full
device list collected and its tests' fixtures set up, one pytest process per file, with the project's
dependencies that the image lacks made unimportable (bench/device/image.py). A module that imports one of
them at the top without a skip fails here, not on the device."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bench.device import image as device_image

REPO = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_every_dependency_has_a_decision_for_the_image():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted += extra
    assert sorted({_name(r) for r in wanted} - set(device_image.DEPENDENCIES)) == []


def _simulated(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, INFERQ_SIMULATE_IMAGE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "bench" / "device" / "simulated_image")])
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)


def test_the_simulated_image_lacks_what_the_image_lacks():
    done = _simulated("import jsonschema")
    assert done.returncode != 0 and "simulated GPU image" in done.stderr
    assert _simulated("import xgrammar.testing").returncode != 0
    assert _simulated("import json, yaml, psutil").returncode == 0, "what the image has stays importable"


@pytest.mark.slow
def test_the_full_device_test_list_collects_and_sets_up_under_the_simulated_image(tmp_path):
    env = dict(
        os.environ,
        DEVICE="cpu",
        TESTS_ONLY="1",
        SIMULATE_IMAGE="1",
        PYTEST_EXTRA="--setup-only",
        BUDGET_SCALE="6",  # a loaded 2-core CI machine imports torch in 10-20 s, a device in 2
        PYTHON=sys.executable,
        OUT=str(tmp_path),
    )
    env.pop("TRITON_INTERPRET", None)
    env.pop("CI", None)  # the image lacks wheels CI has: its skips say so, and CI's skip rule is not for it
    done = subprocess.run(
        ["bash", "bench/device_check.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    rows = re.findall(r"^\| (tests/\S+) \| (\d+) \| \d+ \| \d+ \| (.*) \|$", summary, re.MULTILINE)
    script = (REPO / "bench" / "device_check.sh").read_text()
    listed = re.search(r"TESTS_ALL=\((.*?)\)\n", script, re.DOTALL).group(1).split()
    assert [row[0] for row in rows] == [entry.rsplit(":", 1)[0] for entry in listed]
    for target, code, result in rows:
        # 0: collected and set up (or skipped: no CUDA here); 5: the whole module skipped, with its reason
        assert code == "0" or (code == "5" and "skipped" in result), f"{target}: exit {code}, {result}"
    assert "error" not in summary.lower()
    skips = (tmp_path / "tests.txt").read_text()
    assert "SKIPPED" in skips and "jsonschema is not installed" in skips, "a skip states its reason"
