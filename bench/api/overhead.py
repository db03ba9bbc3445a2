"""`python -m bench.api.overhead`: what `inferq api` adds to a non-streaming completion, at the median.

One tiny-model worker, one `inferq api` process, on a topic prefix and a database of their own (the API's
tables migrated there, so the shared database is left as it is). The same request is made alternately
through the API (a kept-alive HTTP connection, as an SDK holds one) and through `JobClient` (submit, then
wait: what the API does inside), so drift in the worker's speed hits both alike. Overhead = API median -
JobClient median; and, request by request, the API's own time: its latency less the time its request
spent in the queue (JobClient's submit and wait inside the API, reported in a Server-Timing header). The
queue's latency jitters by tens of ms (poll intervals), so the difference of medians is noisy; the own time
is not. The bar of issue 31: at most 5 ms at the median.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from workers.client import JobClient
from workers.services.kafka import ensure_topics
from workers.settings import Settings

BAR_MS = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=200, help="timed requests per path (default: 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed requests per path first")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens per completion (default: 4)")
    parser.add_argument("--json", type=Path, default=None, help="result file (default: bench/results/...)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _database(settings: Settings) -> tuple[str, object]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"inferq_bench_api_{uuid.uuid4().hex[:8]}"
    admin = create_engine(
        make_url(settings.database_url).set(database="postgres"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(settings.database_url).set(database=name).render_as_string(hide_password=False)

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return url, drop


def _scratch(prefix: str) -> tuple[Settings, dict[str, str], object]:
    """A deployment of the bench's own (topics under a fresh prefix, a fresh database, migrated): its
    settings, the environment its processes run with, and what drops the database afterwards."""
    base = Settings.from_env()
    url, drop = _database(base)
    settings = dataclasses.replace(base, topic_prefix=f"{prefix}{uuid.uuid4().hex[:8]}", database_url=url)
    ensure_topics(settings.kafka_connection, settings.topic_partitions(), settings.replication_factor)
    env = {**os.environ, "INFERQ_TOPIC_PREFIX": settings.topic_prefix, "INFERQ_DATABASE_URL": url,
           "INFERQ_KAFKA": settings.kafka, "OMP_NUM_THREADS": "1"}  # fmt: skip
    try:
        _cli(env, "db", "upgrade")
    except BaseException:
        drop()  # type: ignore[operator]
        raise
    return settings, env, drop


def _cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "workers.cli", *args], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"inferq {' '.join(args)}: {done.stderr[-2000:]}")
    return done.stdout


def _wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("inferq api exited")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError("inferq api never became healthy")


def _api_call(conn: http.client.HTTPConnection, key: str, body: bytes) -> tuple[float, float]:
    """(latency, the part of it the API spent outside the queue: latency - its Server-Timing `queue`)."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, headers)
    response = conn.getresponse()
    payload = response.read()
    elapsed = time.perf_counter() - start
    if response.status != 200:
        raise RuntimeError(f"API answered {response.status}: {payload[:300]!r}")
    queue_s = float(response.getheader("Server-Timing", "queue;dur=0").partition("dur=")[2]) / 1000
    return elapsed, elapsed - queue_s


def _direct_call(client: JobClient, job: dict, marks: dict[str, tuple[float, float, float]]) -> float:
    """Submit + wait; `marks[job_id]` = wall-clock (submit called, broker acknowledged, result in hand)."""
    begun, start = time.time(), time.perf_counter()
    sent = client.submit({**job, "job_id": uuid.uuid4().hex})
    acked = time.time()
    result = client.wait(sent, 60)
    elapsed = time.perf_counter() - start
    marks[sent.job_id] = (begun, acked, time.time())
    client.forget(sent)
    if result.status != "succeeded":
        raise RuntimeError(f"job {result.status}: {result.error}")
    return elapsed


# Where a JobClient submit + wait spends its time: the client's marks around the jobs row's timestamps
# (one machine, one clock). Each phase ends at its row's next mark.
PHASES = (
    ("submit: producer send -> broker ack", "begun", "acked"),
    ("ack -> a worker took it off Kafka (queued_at)", "acked", "queued_at"),
    ("queued -> first scheduled (started_at)", "queued_at", "started_at"),
    ("started -> first token", "started_at", "first_token_at"),
    ("first token -> finished", "first_token_at", "finished_at"),
    ("finished -> result published (outbox)", "finished_at", "published_at"),
    ("published -> wait() returned (results read)", "published_at", "done"),
)


def _phases(url: str, marks: dict[str, tuple[float, float, float]]) -> list[list[object]]:
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT job_id, queued_at, started_at, first_token_at, finished_at, published_at FROM jobs"
                " WHERE job_id = ANY(:ids)"
            ),
            {"ids": list(marks)},
        ).all()
    engine.dispose()
    spans: dict[str, list[float]] = {name: [] for name, _, _ in PHASES}
    for row in rows:
        at = {k: v.timestamp() for k, v in row._mapping.items() if k != "job_id" and v is not None}
        at["begun"], at["acked"], at["done"] = marks[row.job_id]
        for name, a, b in PHASES:
            if a in at and b in at:
                spans[name].append((at[b] - at[a]) * 1000)
    return [[name, len(v), statistics.median(v), statistics.fmean(v)] for name, v in spans.items() if v]


def _stats(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    return {
        "n": len(ms),
        "p50_ms": statistics.median(ms),
        "p90_ms": ms[int(0.9 * (len(ms) - 1))],
        "mean_ms": statistics.fmean(ms),
    }


def run(args: argparse.Namespace) -> int:
    from bench.machine import machine_info
    from bench.report import default_json_path, format_table, write_json

    settings, env, drop = _scratch("bapi")
    procs: list[subprocess.Popen] = []
    try:
        key = _cli(env, "api-key", "create", "--tenant", "bench").strip().splitlines()[-1]
        worker = [
            sys.executable,
            "-m",
            "workers.cli",
            "worker",
            "--model",
            "tiny",
            "--worker-id",
            "bench-api",
        ]
        logs = Path(tempfile.mkdtemp(prefix="inferq-bench-api-"))
        procs.append(
            subprocess.Popen(
                worker, env=env, stdout=(logs / "worker.log").open("wb"), stderr=subprocess.STDOUT
            )
        )
        port = _free_port()
        api = [sys.executable, "-m", "workers.cli", "api", "--port", str(port), "--model-name", "tiny"]
        procs.append(
            subprocess.Popen(api, env=env, stdout=(logs / "api.log").open("wb"), stderr=subprocess.STDOUT)
        )
        print(f"logs in {logs}", file=sys.stderr)
        _wait_healthy(port, procs[-1])
        job = {
            "tenant": "bench",
            "prompt": "The queue in front of",
            "max_tokens": args.max_tokens,
            "temperature": 0,
        }
        body = json.dumps({"model": "tiny", "prompt": job["prompt"], "max_tokens": args.max_tokens,
                           "temperature": 0}).encode()  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        api_times: list[float] = []
        own_times: list[float] = []
        direct_times: list[float] = []
        marks: dict[str, tuple[float, float, float]] = {}
        # as the API process builds its own
        with JobClient(settings, database_url=settings.database_url) as client:
            for i in range(args.warmup + args.requests):
                (a, own), d = _api_call(conn, key, body), _direct_call(client, job, marks)
                if i < args.warmup:
                    marks.clear()
                else:
                    api_times.append(a)
                    own_times.append(own)
                    direct_times.append(d)
        conn.close()
        phases = _phases(settings.database_url, marks)
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        drop()
    api_stats, direct_stats, own_stats = _stats(api_times), _stats(direct_times), _stats(own_times)
    difference = api_stats["p50_ms"] - direct_stats["p50_ms"]
    overhead = own_stats["p50_ms"]
    rows = [
        ["JobClient (submit + wait)", direct_stats["n"], direct_stats["p50_ms"], direct_stats["p90_ms"],
         direct_stats["mean_ms"]],
        ["inferq api (POST /v1/completions)", api_stats["n"], api_stats["p50_ms"], api_stats["p90_ms"],
         api_stats["mean_ms"]],
        ["  of which outside the queue (own)", own_stats["n"], own_stats["p50_ms"], own_stats["p90_ms"],
         own_stats["mean_ms"]],
    ]  # fmt: skip
    print(format_table(["path", "n", "p50 ms", "p90 ms", "mean ms"], rows, digits=2))
    print(format_table(["JobClient call, phase", "n", "p50 ms", "mean ms"], phases, digits=1))
    verdict = "within" if overhead <= BAR_MS else "OVER"
    print(f"API's own time at the median: {overhead:.2f} ms ({verdict} the {BAR_MS:g} ms bar)")
    print(f"API - JobClient medians: {difference:+.2f} ms (the queue's jitter dominates this difference); "
          f"tiny model, max_tokens {args.max_tokens}, alternating calls")  # fmt: skip
    payload = {
        "bench": "api_overhead",
        "machine": machine_info(),
        "max_tokens": args.max_tokens,
        "api": api_stats,
        "job_client": direct_stats,
        "api_own": own_stats,
        "overhead_p50_ms": overhead,
        "median_difference_ms": difference,
        "bar_ms": BAR_MS,
        "job_client_phases": [dict(zip(("phase", "n", "p50_ms", "mean_ms"), p, strict=True)) for p in phases],
    }
    path = write_json(args.json or default_json_path("api-overhead"), payload)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.api.overhead", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
