"""Find the external programs the local services need, with an install hint when one is missing."""

from __future__ import annotations

import shutil
from pathlib import Path

from workers.services.process import ServiceError

INSTALL_HINT = "apt-get install openjdk-17-jre-headless maven postgresql-15"
PG_MAJOR = 15  # the version of the contract; a newer major also works, it is only used if 15 is absent
PG_ROOT = Path("/usr/lib/postgresql")  # Debian keeps the server binaries here, off PATH


class MissingTool(ServiceError):
    pass


def program(name: str, what: str) -> str:
    """The path of `name` on PATH, or a MissingTool error saying what to install."""
    found = shutil.which(name)
    if not found:
        raise MissingTool(f"`{name}` ({what}) not found on PATH; install it, e.g. `{INSTALL_HINT}`")
    return found


def java() -> str:
    return program("java", "Java 17+ runtime, runs the Kafka broker")


def mvn() -> str:
    return program("mvn", "Maven, fetches the Kafka jars once")


def postgres_bindir(root: Path = PG_ROOT) -> Path:
    """The bin dir of PostgreSQL 15 (or the newest installed major ≥ 15) holding initdb and postgres."""
    majors = sorted(
        (int(d.name) for d in root.glob("*") if d.name.isdigit() and (d / "bin" / "initdb").exists()),
        key=lambda m: (m != PG_MAJOR, -m),
    )
    usable = [m for m in majors if m >= PG_MAJOR]
    if usable:
        return root / str(usable[0]) / "bin"
    on_path = shutil.which("initdb")
    if on_path and (Path(on_path).parent / "postgres").exists():
        return Path(on_path).parent
    raise MissingTool(
        f"PostgreSQL {PG_MAJOR} server binaries (initdb, postgres) not found under {root} "
        f"or on PATH; install them, e.g. `{INSTALL_HINT}`"
    )
