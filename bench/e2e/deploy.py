"""A private deployment for `bench e2e`: its own topic prefix, one worker subprocess, a token recorder.

The prefix is fresh for every run, so the bench never sees (or disturbs) anyone else's jobs on the
shared local Kafka and PostgreSQL, and the worker's consumer group is its own.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from bench.e2e.stats import Arrival, JobTrace
from workers.settings import Settings


def make_private_settings(base: Settings) -> Settings:
    from workers.services.kafka import ensure_topics

    settings = dataclasses.replace(base, topic_prefix=f"bench{uuid.uuid4().hex[:10]}")
    ensure_topics(settings.kafka_connection, settings.topic_partitions(), settings.replication_factor)
    return settings


def delete_private_topics(settings: Settings) -> None:
    """Remove the run's own topics (names under its unique prefix only), so runs do not pile up."""
    from workers.services.kafka import delete_topics

    delete_topics(settings.kafka_connection, settings.topic_prefix)


# the worker's loop counters bench e2e reads, each with the prefix its names get here
LOOP_METRICS = (("loop_seconds_total{phase", ""), ("loop_thread_seconds_total{kind", "thread:"))


def pid_cpu_s(pid: int | None) -> float | None:
    """CPU seconds a process has used so far (all its threads), from /proc; None where unavailable."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def local_kafka_pid(settings: Settings) -> int | None:
    """The broker `inferq up` started, when it runs on this machine (its CPU is part of the e2e cost here)."""
    try:
        return int((settings.state_dir / "kafka.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class MachineBusy:
    """CPU seconds all processes used since construction, from /proc/stat: minus our own, it says how much the
    other tenants of a shared machine (and Kafka, PostgreSQL) were competing during a measurement."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> float | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")

    def cpu_s(self) -> float | None:
        end = self._read()
        return None if self._start is None or end is None else end - self._start


class WorkerProcess:
    """`inferq worker` as a subprocess on the deployment's prefix; its output goes to a log file."""

    def __init__(
        self,
        settings: Settings,
        log: Path,
        threads: int,
        extra: Iterable[str] = (),
        launcher: Iterable[str] = ("-m", "workers.cli", "worker"),
        env_extra: dict[str, str] | None = None,
    ) -> None:
        """`launcher`: what runs `inferq worker` (bench.pipeline's adds stubs and counters)."""
        env = {**os.environ, "INFERQ_TOPIC_PREFIX": settings.topic_prefix, "INFERQ_KAFKA": settings.kafka,
               "INFERQ_DATABASE_URL": settings.database_url, "OMP_NUM_THREADS": str(threads),
               **(env_extra or {})}  # fmt: skip
        self.worker_id = f"{settings.topic_prefix}-w{threads}"
        self.settings = settings
        self.log = log
        self.metrics_port = _free_port()
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, *launcher, "--worker-id", self.worker_id,
               "--metrics-port", str(self.metrics_port), *extra]  # fmt: skip
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_s(self) -> float:
        """CPU seconds the worker has used so far: all its threads and its token-event relay process."""
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            children = []
        return sum(pid_cpu_s(p) or 0.0 for p in (self.proc.pid, *(c.pid for c in children)))

    def loop_seconds(self) -> dict[str, float]:
        """The worker's engine-loop seconds by phase so far (its `inferq:loop_seconds` metric), and its loop
        thread's as `thread:cpu` and `thread:runqueue` (`inferq:loop_thread_seconds`)."""
        import urllib.request

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        out = {}
        for line in text.splitlines():
            for metric, prefix in LOOP_METRICS:
                if line.startswith(f'inferq:{metric}="'):
                    name, value = line.rsplit(" ", 1)
                    out[prefix + name.split('"')[1]] = float(value)
        return out

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"worker exited with {self.proc.returncode}; log tail:\n{tail}")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (the worker hands its jobs over within its drain timeout), SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_joined(settings: Settings, worker: WorkerProcess, timeout_s: float = 300.0) -> None:
    """Until the deployment's consumer group is stable with one member: the worker is serving."""
    from workers.services.kafka import wait_for_workers

    wait_for_workers(settings, 1, timeout_s, worker.check_alive)


class TokenRecorder:
    """Reads the deployment's tokens topic on a thread and notes when each job's events arrive."""

    def __init__(self, settings: Settings) -> None:
        from workers.client.token_events import TokenEventReader

        since_ms = int(time.time() * 1000) - 60_000  # a fresh topic: everything on it is ours
        self._reader = TokenEventReader(settings, since_ms, "inferq-bench")
        self._arrivals: dict[str, list[Arrival]] = {}
        self._finished: set[str] = set()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bench-token-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:

        try:
            while not self._stop.is_set():
                records = self._reader.poll(0.05)
                now = time.perf_counter()
                if not records:
                    continue
                with self._cond:
                    for event in records:  # each (job, attempt, seq) once, producer retries aside
                        final = event.final
                        usage = event.usage.completion_tokens if event.usage else None
                        arrival = Arrival(now, len(event.token_ids), final, usage)
                        self._arrivals.setdefault(event.job_id, []).append(arrival)
                        if final:
                            self._finished.add(event.job_id)
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - surfaced to the waiting thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            self._reader.close()

    def started(self, job_ids: Iterable[str]) -> int:
        with self._cond:
            return sum(1 for j in job_ids if self._arrivals.get(j))

    def wait_started(self, job_ids: list[str], count: int, timeout_s: float) -> int:
        """Until `count` of the jobs have streamed something (or the timeout); returns how many have."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                have = sum(1 for j in job_ids if self._arrivals.get(j))
                left = deadline - time.monotonic()
                if have >= count or left <= 0 or self._error is not None:
                    return have
                self._cond.wait(min(left, 0.5))

    def wait_finished(self, job_ids: list[str], timeout_s: float, worker: WorkerProcess | None) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._error is not None:
                    raise RuntimeError("token recorder failed") from self._error
                missing = [j for j in job_ids if j not in self._finished]
                if not missing:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{len(missing)}/{len(job_ids)} jobs unfinished after {timeout_s:.0f}s"
                    )
                if worker is not None:
                    worker.check_alive()
                self._cond.wait(0.5)

    def traces(self, submitted: dict[str, float]) -> list[JobTrace]:
        with self._cond:
            return [JobTrace(j, t, tuple(self._arrivals.get(j, ()))) for j, t in submitted.items()]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
