"""Shared fixtures: settings, a database engine, scratch databases, the `services` rule and the CI rule.

Tests marked `services` use the real Kafka and PostgreSQL of `inferq up` (`bash dev.sh test` starts them).
When those are down such tests FAIL with a message saying so; they never skip, so a CI run without
services cannot pass by running nothing.

In CI (`CI=true`) a skip is a failure unless its reason is one this machine cannot help (ALLOWED_IN_CI):
CI installs every wheel of dev.sh, starts Kafka and PostgreSQL and has a C compiler, so any other skip
means a test that stopped checking (a broken loader skipping a gold test would otherwise turn it green).

Triton runs in its interpreter on a machine without CUDA: TRITON_INTERPRET=1 is set for the whole
session just before triton is first imported, whoever imports it (the kernel tests, or torch._dynamo in
another module collected earlier); triton reads it at import, so setting it later would come too late.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import settings as hypothesis_settings

from workers.settings import Settings

# Property tests check logic, not speed: on a loaded 2-core machine per-example deadlines only add flakes.
hypothesis_settings.register_profile("inferq", deadline=None)
hypothesis_settings.load_profile("inferq")

CI = os.environ.get("CI", "").lower() == "true"
NO_CUDA = "this machine has no CUDA device"  # the reason every CUDA-only test gives when it skips
ALLOWED_IN_CI = (NO_CUDA,)  # skip reasons CI accepts: each names what this machine lacks


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def _refuse_in_ci(report: pytest.CollectReport | pytest.TestReport) -> None:
    """A skip CI does not accept becomes a failure that says why."""
    if not (CI and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if any(allowed in reason for allowed in ALLOWED_IN_CI):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped in CI: {reason!r}. CI=true runs everything this machine can run; a skip is accepted only "
        f"when its reason says one of {ALLOWED_IN_CI} (tests/conftest.py)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    _refuse_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _refuse_in_ci(outcome.get_result())  # a whole module skipped (importorskip, allow_module_level)


class _InterpretTritonWithoutCuda(importlib.abc.MetaPathFinder):
    """Sets TRITON_INTERPRET=1 when triton is first imported on a machine without CUDA (then steps aside)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "triton":
            sys.meta_path.remove(self)
            import torch

            if not torch.cuda.is_available():
                os.environ["TRITON_INTERPRET"] = "1"
        return None  # the import itself goes on as usual


if "triton" not in sys.modules:
    sys.meta_path.insert(0, _InterpretTritonWithoutCuda())


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings.from_env()


@pytest.fixture(scope="session")
def services_up(settings: Settings) -> None:
    from workers.services import manager

    down = [s for s in manager.status(settings) if not s.healthy]
    if down:
        names = ", ".join(f"{s.name} at {s.address}" for s in down)
        pytest.fail(
            f"services down: {names}. Start them with `inferq up` (or run `bash dev.sh test`).", pytrace=False
        )


@pytest.fixture(autouse=True)
def _require_services(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("services"):
        request.getfixturevalue("services_up")


@pytest.fixture(scope="session")
def db_engine(settings: Settings, services_up: None):
    """An engine on the shared, migrated database. Other people use it too: use unique keys, clean up."""
    from sqlalchemy import create_engine

    engine = create_engine(settings.database_url, pool_pre_ping=True)
    yield engine
    engine.dispose()


@pytest.fixture
def scratch_database(settings: Settings, services_up: None) -> Iterator[str]:
    """The URL of a new, empty database on the same server, dropped afterwards."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"inferq_scratch_{uuid.uuid4().hex[:12]}"
    admin = create_engine(
        make_url(settings.database_url).set(database="postgres"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(settings.database_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
