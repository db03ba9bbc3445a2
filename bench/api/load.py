"""`inferq bench api-load`: the HTTP API's front door under load: 2,000 concurrent non-streaming requests and
500 concurrent streams at once against one `inferq api` process and one tiny-model worker.

While they run: the API process's resident memory (its peak, sampled every 20 ms) and the latency of
`/health` (probed every 50 ms by a process of its own on a connection of its own, so the load generator's
event loop does not delay the probe), beside the latency of a control: a server that does nothing but
answer, in a process of its own, probed the same way at the same time, so what the machine's own load adds
(its cores shared with the worker, the load generator and whatever else runs) is read apart from what the
API adds; and afterwards the `jobs` rows against the requests made (one row per
request: nothing posted twice, nothing lost). The bars of issue 40: the API process under 1 GB, `/health`
p99 under 100 ms. Everything runs on a topic prefix and a database of its own (the API's tables migrated
there); the requests are short (the tiny model, a few tokens), so what is measured is the API's holding of
thousands of waiting requests, not the model.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from bench.api.overhead import _cli, _free_port, _scratch, _wait_healthy

RSS_BAR_MB = 1024.0
HEALTH_P99_BAR_MS = 100.0
PROBE_EVERY_S = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="concurrent non-streaming requests")
    parser.add_argument("--streams", type=int, default=500, help="concurrent streams, beside them")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (default: 8)")
    parser.add_argument("--json", type=Path, default=None, help="result file (default: bench/results/...)")


def _probe(ports: tuple[int, int], stop, out) -> None:
    """(In a process of its own.) Latencies in ms of the API's /health and of the control's, alternately,
    until `stop` is set, sent through `out`."""
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for port in ports]
    latencies: list[list[tuple[float, bool]]] = [[], []]
    while not stop.is_set():
        for i, port in enumerate(ports):
            start = time.perf_counter()
            try:
                conns[i].request("GET", "/health")
                response = conns[i].getresponse()
                response.read()
                ok = response.status == 200
            except OSError:
                ok = False
                conns[i] = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            latencies[i].append(((time.perf_counter() - start) * 1000, ok))
        stop.wait(PROBE_EVERY_S)
    out.send(latencies)


def _control(port: int) -> None:
    """(In a process of its own.) An HTTP server that answers every request with 200 and nothing else."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()  # the prober is done

    async def main() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


class _PeakRSS(threading.Thread):
    def __init__(self, pid: int) -> None:
        import psutil

        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.start_mb = self.peak_mb = self.process.memory_info().rss / 2**20
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.peak_mb = max(self.peak_mb, self.process.memory_info().rss / 2**20)
            self.halt.wait(0.02)


async def _load(port: int, key: str, args: argparse.Namespace, tag: str) -> dict[str, object]:
    import httpx2 as httpx

    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {key}"}
    total = args.requests + args.streams
    limits = httpx.Limits(max_connections=total + 16, max_keepalive_connections=total + 16)
    outcomes: dict[str, int] = {}
    latencies: list[float] = []
    first_chunks: list[float] = []

    def note(what: str) -> None:
        outcomes[what] = outcomes.get(what, 0) + 1

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def answer(i: int) -> None:
            body = {"model": "tiny", "prompt": f"{tag} request {i}", "max_tokens": args.max_tokens}
            start = time.perf_counter()
            try:
                response = await http.post("/v1/completions", json=body, headers=headers)
                note(f"answer {response.status_code}")
                latencies.append(time.perf_counter() - start)
            except httpx.HTTPError as exc:
                note(f"answer {type(exc).__name__}")

        async def stream(i: int) -> None:
            body = {
                "model": "tiny",
                "prompt": f"{tag} stream {i}",
                "max_tokens": args.max_tokens,
                "stream": True,
            }
            start = time.perf_counter()
            try:
                async with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
                    done, first = False, None
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and first is None:
                            first = time.perf_counter() - start
                        done |= line == "data: [DONE]"
                    note(f"stream {response.status_code}{'' if done else ' unfinished'}")
                    if first is not None:
                        first_chunks.append(first)
            except httpx.HTTPError as exc:
                note(f"stream {type(exc).__name__}")

        began = time.perf_counter()
        await asyncio.gather(
            *(answer(i) for i in range(args.requests)), *(stream(i) for i in range(args.streams))
        )
        wall = time.perf_counter() - began
    return {"outcomes": outcomes, "latencies": latencies, "first_chunks": first_chunks, "wall_s": wall}


def _rows(url: str, tag: str) -> tuple[int, int]:
    """(jobs rows of this run, distinct requests among them)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.connect() as conn:
        rows, distinct = conn.execute(
            text("SELECT count(*), count(DISTINCT prompt) FROM jobs WHERE prompt LIKE :t"), {"t": f"{tag} %"}
        ).one()
    engine.dispose()
    return int(rows), int(distinct)


def _largest(values: list[float]) -> float:
    return max(values, default=float("nan"))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(args: argparse.Namespace) -> int:
    from bench.machine import machine_info
    from bench.report import default_json_path, format_table, write_json

    settings, env, drop = _scratch("bload")
    procs: list[subprocess.Popen] = []
    tag = f"bench-load-{uuid.uuid4().hex[:8]}"
    try:
        key = _cli(env, "api-key", "create", "--tenant", "bench").strip().splitlines()[-1]
        logs = Path(tempfile.mkdtemp(prefix="inferq-bench-api-load-"))
        worker = [sys.executable, "-m", "workers.cli", "worker", "--model", "tiny",
                  "--served-model-name", "tiny", "--worker-id", "bench-api-load"]  # fmt: skip
        procs.append(subprocess.Popen(worker, env=env, stdout=(logs / "worker.log").open("wb"),
                                      stderr=subprocess.STDOUT))  # fmt: skip
        port = _free_port()
        api = [sys.executable, "-m", "workers.cli", "api", "--port", str(port)]
        procs.append(
            subprocess.Popen(api, env=env, stdout=(logs / "api.log").open("wb"), stderr=subprocess.STDOUT)
        )
        print(f"logs in {logs}", file=sys.stderr)
        _wait_healthy(port, procs[-1])
        _wait_model(port, key, procs)
        asyncio.run(_load(port, key, argparse.Namespace(requests=20, streams=5, max_tokens=2), f"{tag}-warm"))
        rss = _PeakRSS(procs[-1].pid)
        control_port = _free_port()
        control = multiprocessing.Process(target=_control, args=(control_port,), daemon=True)
        control.start()
        stop, (receive, send) = multiprocessing.Event(), multiprocessing.Pipe(duplex=False)
        prober = multiprocessing.Process(target=_probe, args=((port, control_port), stop, send), daemon=True)
        time.sleep(1)  # the control listens
        rss.start()
        prober.start()
        result = asyncio.run(_load(port, key, args, tag))
        stop.set()
        probes, control_probes = receive.recv()
        prober.join(30)
        control.terminate()
        rss.halt.set()
        rss.join()
        rows, distinct = _rows(settings.database_url, tag)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        drop()
    health = [ms for ms, _ in probes]
    health_failed = sum(not ok for _, ok in probes)
    idle = [ms for ms, _ in control_probes]
    c50, c99 = _percentile(idle, 0.5), _percentile(idle, 0.99)
    intended = args.requests + args.streams
    p50, p99 = _percentile(health, 0.5), _percentile(health, 0.99)
    latencies = result["latencies"]
    rows_table = [
        ["requests made (non-streaming + streams)", f"{args.requests} + {args.streams}"],
        ["outcomes", ", ".join(f"{k}: {v}" for k, v in sorted(result["outcomes"].items()))],
        ["wall time, all answered (s)", result["wall_s"]],
        ["non-streaming latency p50 / p99 (s)",
         f"{_percentile(latencies, 0.5):.2f} / {_percentile(latencies, 0.99):.2f}"],
        ["streams' first chunk p50 (s)", _percentile(result["first_chunks"], 0.5)],
        ["jobs rows / intended (distinct)", f"{rows} / {intended} ({distinct})"],
        ["API RSS before / peak (MB)", f"{rss.start_mb:.0f} / {rss.peak_mb:.0f}"],
        ["/health probes (failed)", f"{len(health)} ({health_failed})"],
        ["/health p50 / p99 / max (ms)", f"{p50:.1f} / {p99:.1f} / {_largest(health):.1f}"],
        ["control server p50 / p99 / max (ms)", f"{c50:.1f} / {c99:.1f} / {_largest(idle):.1f}"],
        ["/health p99 / control p99", p99 / c99 if c99 else float("nan")],
    ]  # fmt: skip
    print(format_table(["api-load: tiny model, one worker, one API process", "value"], rows_table, digits=2))
    rss_ok, health_ok = rss.peak_mb < RSS_BAR_MB, p99 < HEALTH_P99_BAR_MS and not health_failed
    print(f"bars: API RSS peak {rss.peak_mb:.0f} MB {'<' if rss_ok else '>='} {RSS_BAR_MB:.0f} MB; "
          f"/health p99 {p99:.1f} ms {'<' if health_ok else '>='} {HEALTH_P99_BAR_MS:.0f} ms; "
          f"one jobs row a request: {rows == intended == distinct}")  # fmt: skip
    payload = {
        "bench": "api_load",
        "machine": machine_info(),
        "requests": args.requests,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "outcomes": result["outcomes"],
        "wall_s": result["wall_s"],
        "latency_p50_s": _percentile(latencies, 0.5),
        "latency_p99_s": _percentile(latencies, 0.99),
        "stream_first_chunk_p50_s": _percentile(result["first_chunks"], 0.5),
        "jobs_rows": rows,
        "jobs_distinct": distinct,
        "intended": intended,
        "api_rss_start_mb": rss.start_mb,
        "api_rss_peak_mb": rss.peak_mb,
        "health": {"n": len(health), "failed": health_failed, "p50_ms": p50, "p99_ms": p99,
                   "max_ms": max(health, default=None),
                   "mean_ms": statistics.fmean(health) if health else None},
        "control": {"n": len(idle), "p50_ms": c50, "p99_ms": c99, "max_ms": max(idle, default=None)},
        "bars": {"rss_mb": RSS_BAR_MB, "health_p99_ms": HEALTH_P99_BAR_MS, "rss_ok": rss_ok,
                 "health_ok": health_ok},
    }  # fmt: skip
    path = write_json(args.json or default_json_path("api_load"), payload)
    print(f"results: {path}")
    return 0 if rss_ok and health_ok and rows == intended == distinct else 1


def _wait_model(port: int, key: str, procs: list[subprocess.Popen], timeout_s: float = 180) -> None:
    """Until the worker announced its model (it serves)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("the worker or the API exited")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        if b'"tiny"' in conn.getresponse().read():
            return
        time.sleep(0.5)
    raise RuntimeError("the worker never announced its model")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
