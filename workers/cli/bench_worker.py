"""The worker `bench.pipeline` measures: `python -m workers.cli.bench_worker ARGS` runs `inferq worker ARGS`.

Two additions, both for the benchmark only:
- INFERQ_BENCH_INSTANT=1: the model's forward is stubbed (bench.host_overhead.steps.StubForward: fixed
  logits, one printable token, never EOS), so every job runs to its max_tokens and the worker's own cost
  is what is left;
- INFERQ_BENCH_STATS=PATH: every 0.25 s (and at exit) PATH gets the process's CPU seconds by thread name and
  its database traffic so far (workers.db.traffic: statements, round trips, transactions) and its engine's
  step count;
- INFERQ_BENCH_PROFILE=PATH: the engine loop's thread runs under cProfile, its stats written to PATH.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

from workers.db.traffic import count_traffic, traffic

_WORKER_ID = re.compile(r"-?inferq-bench[0-9a-f]+-w\d+")  # kafka-python's thread names carry the client id


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds by thread name: Python threads by their names, the rest (torch's pool) as `other`."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(task.name), "other")
        name = "Thread" if name.startswith("Thread") else _WORKER_ID.sub("", name).strip("-")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class StatsWriter:
    """Cumulative per-thread CPU (a thread that ended keeps its last figure) and the DB counts, to a file."""

    def __init__(self, path: Path, period_s: float = 0.25) -> None:
        self._path, self._period_s = path, period_s
        self._by_tid: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="bench-stats", daemon=True)

    def start(self) -> None:
        self._thread.start()
        atexit.register(self.write)

    def _run(self) -> None:
        while True:
            self.write()
            time.sleep(self._period_s)

    def write(self) -> None:
        counts = traffic()
        if _ENGINE:  # plain attributes: safe to read from this thread
            engine = _ENGINE[0]
            counts["engine_steps"] = engine._steps if hasattr(engine, "_steps") else engine.stats().steps
        payload = {"at": time.time(), "threads": thread_cpu_s(), "db": counts}
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload))
        tmp.replace(self._path)


_ENGINE: list = []  # the worker's engine, once built (its step count goes into the stats)


def wrap_engine(instant: bool) -> None:
    """Wrap the worker's engine builder: keep the engine, and (instant) stub its forward."""
    from bench.host_overhead.steps import StubForward
    from bench.pipeline import stub_forward
    from workers.cli import worker

    build = worker.build_engine

    def built(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        engine = build(*args, **kwargs)
        if instant:
            stub_forward(engine, StubForward)
        _ENGINE.append(engine)
        return engine

    worker.build_engine = built
    worker.build_warm_engine = build_warm_engine_for_bench  # --engine-process: built in the child
    from gpu import engine_process

    process_type = engine_process.EngineProcess

    def in_process(build_in_child):  # noqa: ANN001, ANN202
        engine = process_type(build_in_child)
        _ENGINE.append(engine)
        return engine

    engine_process.EngineProcess = in_process


def build_warm_engine_for_bench(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    """In the engine's own process (so: module level): the worker's engine, its forward stubbed when the
    bench asks for the instant engine (the child inherits the environment)."""
    from bench.host_overhead.steps import StubForward
    from bench.pipeline import stub_forward
    from workers.cli.engine_options import build_warm_engine

    engine = build_warm_engine(*args, **kwargs)
    if os.environ.get("INFERQ_BENCH_INSTANT") == "1":
        stub_forward(engine, StubForward)
    return engine


def profile_loop(path: Path) -> None:
    """Profile the engine loop's thread (cProfile) and write its stats to `path` when it ends."""
    import cProfile

    from workers.serving.loop.worker import Worker

    run = Worker.run

    def profiled(self) -> None:  # noqa: ANN001
        profiler = cProfile.Profile()
        try:
            profiler.runcall(run, self)
        finally:
            profiler.dump_stats(str(path))

    Worker.run = profiled


def main() -> int:
    stats = os.environ.get("INFERQ_BENCH_STATS")
    if stats:
        count_traffic()
        StatsWriter(Path(stats)).start()
    wrap_engine(os.environ.get("INFERQ_BENCH_INSTANT") == "1")
    if os.environ.get("INFERQ_BENCH_PROFILE"):
        profile_loop(Path(os.environ["INFERQ_BENCH_PROFILE"]))
    from workers.cli.main import main as cli_main

    return cli_main(["worker", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
