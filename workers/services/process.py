"""Background processes tracked by pid files: spawn, check, wait until ready, stop.

A pid file holds the pid and the process's start time, so a pid reused by an unrelated process after a
crash (kill -9, reboot) is never mistaken for ours, and `down` never signals anything it did not start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from workers.services.paths import PRIVATE_UMASK, open_private, private_dir, write_private

POLL_S = 0.2  # between readiness probes; each probe is a real protocol request


class ServiceError(RuntimeError):
    """A service could not be started, reached or stopped; the message says what to do."""


def write_pid(path: Path, pid: int) -> None:
    started = psutil.Process(pid).create_time()
    tmp = path.with_suffix(".tmp")
    write_private(tmp, f"{pid} {started!r}\n")
    tmp.replace(path)


def live_pid(path: Path, marker: str | None = None) -> int | None:
    """The pid recorded in `path` if that very process still runs; None for a stale or missing file.

    That very process: same start time, or (`marker`) a command line naming this state's own files. The
    start time alone is not enough: psutil derives it from the boot time, which moves when the wall clock
    is stepped (seen here: 10 s on a restored VM), and `down` would then leave the services running."""
    try:
        pid_text, started_text = path.read_text().split()
        pid, started = int(pid_text), float(started_text)
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        same = abs(proc.create_time() - started) <= 1.0
        if not same and not (marker and marker in " ".join(proc.cmdline())):
            return None
    except (OSError, ValueError, psutil.Error):
        return None
    return pid


def spawn(argv: Sequence[str], log: Path, user: str | None = None, cwd: Path | None = None) -> int:
    """Start `argv` detached (own session, no stdin), appending its output to `log`; return its pid. What
    it writes, `log` and the files it makes, is owner-only (see paths.py)."""
    private_dir(log.parent)
    # The log is opened here, by us, so the child needs no access to the state dir (see paths.py).
    with os.fdopen(open_private(log, os.O_WRONLY | os.O_APPEND), "ab") as out:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            user=user,
            cwd=cwd,
            umask=PRIVATE_UMASK,
        )
    return proc.pid


def wait_ready(name: str, pid: int, probe: Callable[[], bool], log: Path, timeout_s: float) -> None:
    """Probe until it answers; fail early, with the log's tail, if the process exits meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        if probe():
            return
        if not _alive(pid):
            raise ServiceError(f"{name} exited while starting; last lines of {log}:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise ServiceError(
                f"{name} (pid {pid}) not ready after {timeout_s:.0f}s; see {log}:\n{tail(log)}"
            )
        time.sleep(POLL_S)


def stop(
    pid_file: Path,
    polite: signal.Signals = signal.SIGTERM,
    timeout_s: float = 30.0,
    marker: str | None = None,
) -> int | None:
    """Stop the process recorded in `pid_file` (polite signal, then SIGKILL); return its pid if it ran."""
    pid = live_pid(pid_file, marker)
    if pid is not None:
        proc = psutil.Process(pid)
        try:
            proc.send_signal(polite)
            proc.wait(timeout_s)
        except psutil.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        except psutil.NoSuchProcess:
            pass
    pid_file.unlink(missing_ok=True)
    return pid


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def is_root() -> bool:
    return os.geteuid() == 0
