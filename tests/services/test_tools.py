"""Finding binaries and parsing addresses, without services."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.services import kafka, postgres, tools
from workers.services.paths import ServicePaths


def _fake_postgres(root: Path, major: int) -> None:
    bindir = root / str(major) / "bin"
    bindir.mkdir(parents=True)
    (bindir / "initdb").touch()


def test_missing_programs_say_what_to_install(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    for find in (tools.java, tools.mvn, lambda: tools.postgres_bindir(tmp_path)):
        with pytest.raises(tools.MissingTool, match="apt-get install openjdk-17-jre-headless maven"):
            find()


def test_postgres_15_is_preferred_and_older_majors_are_not_used(tmp_path) -> None:
    _fake_postgres(tmp_path, 16)
    assert tools.postgres_bindir(tmp_path) == tmp_path / "16" / "bin"
    _fake_postgres(tmp_path, 15)
    _fake_postgres(tmp_path, 14)
    assert tools.postgres_bindir(tmp_path) == tmp_path / "15" / "bin"


def test_only_a_single_loopback_broker_is_managed() -> None:
    assert kafka.loopback_port("127.0.0.1:19092") == 19092
    assert kafka.loopback_port("localhost:9092") == 9092
    assert kafka.loopback_port("kafka:9092") is None
    assert kafka.loopback_port("127.0.0.1:1,127.0.0.1:2") is None


def test_only_a_loopback_database_is_managed() -> None:
    assert postgres.loopback_url("postgresql+psycopg2://postgres@127.0.0.1:15432/inferq").port == 15432
    assert postgres.loopback_url("postgresql+psycopg2://u:p@db.example:5432/inferq") is None


def test_each_checkout_gets_its_own_postgres_dir_reachable_by_the_postgres_user(tmp_path) -> None:
    a = ServicePaths(state_dir=tmp_path / "a" / ".state", cache_dir=tmp_path)
    b = ServicePaths(state_dir=tmp_path / "b" / ".state", cache_dir=tmp_path)
    assert a.postgres_home != b.postgres_home
    assert a.postgres_home == ServicePaths(state_dir=a.state_dir, cache_dir=tmp_path).postgres_home
    assert a.postgres_home.parent == Path("/tmp")
