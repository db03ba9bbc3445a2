"""Pid files: a stale or reused pid is never taken for ours; `stop` ends exactly the recorded process."""

from __future__ import annotations

import signal
import sys

import psutil

from workers.services import process


def _sleeper(tmp_path) -> int:
    return process.spawn([sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "sleeper.log")


def test_a_recorded_live_process_is_found_and_stop_ends_it(tmp_path) -> None:
    pid_file = tmp_path / "x.pid"
    pid = _sleeper(tmp_path)
    process.write_pid(pid_file, pid)
    assert process.live_pid(pid_file) == pid

    assert process.stop(pid_file, signal.SIGTERM, timeout_s=10) == pid
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not pid_file.exists()
    assert process.stop(pid_file) is None


def test_a_dead_or_reused_pid_is_stale(tmp_path) -> None:
    pid_file = tmp_path / "x.pid"
    pid = _sleeper(tmp_path)
    process.write_pid(pid_file, pid)
    psutil.Process(pid).kill()
    psutil.Process(pid).wait(10)
    assert process.live_pid(pid_file) is None

    # our own pid with another start time: a pid reused by an unrelated process after a crash
    pid_file.write_text(f"{psutil.Process().pid} 12345.0\n")
    assert process.live_pid(pid_file) is None
    assert process.stop(pid_file) is None  # and nothing is signalled
    assert not pid_file.exists()


def test_garbage_in_a_pid_file_is_stale(tmp_path) -> None:
    pid_file = tmp_path / "x.pid"
    pid_file.write_text("not a pid\n")
    assert process.live_pid(pid_file) is None
    assert process.live_pid(tmp_path / "missing.pid") is None


def test_a_stepped_clock_does_not_orphan_a_service(tmp_path) -> None:
    """psutil's start time moves when the wall clock is stepped: the service's own marker on its command
    line still identifies it, so `down` stops it rather than forgetting it."""
    marker = str(tmp_path / "state-marker")
    pid = process.spawn(
        [sys.executable, "-c", "import time, sys; time.sleep(120)", marker], tmp_path / "sleeper.log"
    )
    pid_file = tmp_path / "x.pid"
    started = psutil.Process(pid).create_time()
    pid_file.write_text(f"{pid} {started - 10.0!r}\n")  # as if recorded before a 10 s clock step
    assert process.live_pid(pid_file) is None
    assert process.live_pid(pid_file, marker="/elsewhere/state") is None
    assert process.live_pid(pid_file, marker=marker) == pid
    assert process.stop(pid_file, signal.SIGTERM, timeout_s=10, marker=marker) == pid
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
