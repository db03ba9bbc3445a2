"""The state of `inferq up` is owner-only: folders 0700, files 0600, and what the services write too.

The logs and Kafka's segments hold prompts, the state dir the database password. Each test runs under the
common umask 022, under which none of this would be private by default.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.services import kafka, manager, postgres, process
from workers.services.paths import ServicePaths, private_dir


@pytest.fixture(autouse=True)
def _usual_umask() -> Iterator[None]:
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _paths(tmp_path: Path) -> ServicePaths:
    return ServicePaths(state_dir=tmp_path / "home" / "checkout" / ".state", cache_dir=tmp_path / "cache")


def test_a_new_folder_and_its_missing_parents_are_owner_only_an_existing_one_is_left(tmp_path) -> None:
    tmp_path.chmod(0o755)
    made = private_dir(tmp_path / "a" / "b" / "state")
    assert made == tmp_path / "a" / "b" / "state"
    assert [_mode(p) for p in (made, made.parent, made.parent.parent)] == [0o700] * 3
    assert _mode(tmp_path) == 0o755  # not ours to change
    assert private_dir(made) == made and _mode(made) == 0o700


def test_the_state_dir_its_lock_and_pid_files_are_owner_only(tmp_path) -> None:
    paths = _paths(tmp_path)
    with manager._locked(paths):
        pass
    assert _mode(paths.state_dir) == 0o700
    assert _mode(paths.lock) == 0o600
    process.write_pid(paths.pid_file("kafka"), os.getpid())
    assert _mode(paths.pid_file("kafka")) == 0o600


def test_the_password_file_and_its_folder_are_owner_only(tmp_path) -> None:
    paths = _paths(tmp_path)
    postgres.ensure_password(paths.postgres_password)
    assert _mode(paths.state_dir) == 0o700 and _mode(paths.postgres_password) == 0o600


def test_kafkas_folders_and_config_are_owner_only_and_a_config_from_before_is_made_so(tmp_path) -> None:
    paths = _paths(tmp_path)
    private_dir(paths.kafka_dir)
    (paths.kafka_dir / "server.properties").write_text("from an earlier start")
    (paths.kafka_dir / "server.properties").chmod(0o644)
    config = kafka._write_config(paths, 39092)
    assert [_mode(p) for p in (paths.kafka_dir, paths.kafka_data)] == [0o700, 0o700]
    assert [_mode(p) for p in (config, paths.kafka_dir / "log4j2.properties")] == [0o600, 0o600]
    assert "listeners=PLAINTEXT://127.0.0.1:39092" in config.read_text()


def test_a_service_writes_its_log_and_its_own_files_owner_only(tmp_path) -> None:
    """The umask the services run under: Kafka's segments and anything else they create are 0600/0700."""
    paths = _paths(tmp_path)
    log = paths.log("kafka")
    private_dir(log.parent)
    log.write_text("a line from an earlier start\n")
    log.chmod(0o644)  # a log from before: made owner-only as it is opened again
    script = "import os; os.mkdir('segments'); open('segments/00.log', 'w').write('x'); print('done')"
    pid = process.spawn([sys.executable, "-c", script], log, cwd=tmp_path)
    os.waitpid(pid, 0)
    assert _mode(tmp_path / "segments") == 0o700 and _mode(tmp_path / "segments" / "00.log") == 0o600
    assert _mode(log) == 0o600 and _mode(paths.logs) == 0o700
    assert log.read_text().splitlines() == ["a line from an earlier start", "done"]
