"""The Dockerfile, read as a builder would: layer order, what it copies, who runs it, its port and check.

No Docker engine runs here; these checks fail on the mistakes that matter (an edit reinstalling torch,
a package left out of the image, root at run time, a health check on a port nobody serves).
"""

from __future__ import annotations

import re
import tomllib

import pytest

from workers.settings import ENV_VARIABLES, REPO_ROOT


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = (REPO_ROOT / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.fixture(scope="module")
def steps() -> list[tuple[str, str]]:
    return instructions()


def _index(steps, word: str, contains: str = "") -> int:
    return next(i for i, (w, rest) in enumerate(steps) if w == word and contains in rest)


def test_dependencies_are_installed_before_the_source_is_copied(steps):
    copies = [(i, rest) for i, (w, rest) in enumerate(steps) if w == "COPY"]
    first_copy = copies[0]
    assert first_copy[1].split() == ["pyproject.toml", "./"], "only pyproject.toml before the dependencies"
    deps = _index(steps, "RUN", "pip install -r requirements.txt")
    assert first_copy[0] < deps < copies[1][0]
    package = _index(steps, "RUN", "pip install --no-deps .")
    assert all(i < package for i, _ in copies), "the source install comes after every COPY"


def test_the_image_holds_every_package_pyproject_ships(steps):
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    wanted = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {rest.split()[0] for w, rest in steps if w == "COPY"}
    assert wanted <= copied
    for path in copied:
        assert (REPO_ROOT / path).exists(), f"COPY {path}: no such path"
    assert pyproject["project"]["readme"] in copied  # setuptools reads it while building


def test_it_runs_as_a_user_that_owns_its_cache_and_state(steps):
    users = [rest for w, rest in steps if w == "USER"]
    assert users and users[-1] not in ("root", "0")
    setup = steps[_index(steps, "RUN", "useradd")][1]
    assert f"chown {users[-1]}:{users[-1]}" in setup
    assert "$INFERQ_CACHE" in setup and "$INFERQ_STATE_DIR" in setup
    assert _index(steps, "RUN", "useradd") < _index(steps, "USER") < _index(steps, "ENTRYPOINT")


def test_it_exposes_and_checks_the_metrics_port(steps):
    env = " ".join(rest for w, rest in steps if w == "ENV")
    port = re.search(r"INFERQ_METRICS_PORT=(\d+)", env).group(1)
    assert ("EXPOSE", port) in steps
    check = steps[_index(steps, "HEALTHCHECK")][1]
    assert "INFERQ_METRICS_PORT" in check and "/health" in check  # 503 while engine steps fail


def test_its_inferq_variables_are_settings(steps):
    env = " ".join(rest for w, rest in steps if w == "ENV")
    assert set(re.findall(r"(INFERQ_[A-Z_]+)=", env)) <= set(ENV_VARIABLES)
