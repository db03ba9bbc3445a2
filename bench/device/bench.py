"""`python -m bench.device.bench SHAPE`: one model shape on the device, everything bench/device_check.sh
reports for it, in one process: the engine's start-up (kernel choice and graph capture), inferq's tok/s on
the seeded workload against HF continuous batching (on fewer requests where HF is slow), the decode step
at fixed batch sizes with the share of it the GPU is busy (profiled kernel time / unprofiled wall time),
and a short profile table of one decode step's kernels.

Weights are random, made on the device (bench/device/models.py). The JSON is rewritten after every phase,
so a phase cut short by the script's timeout still leaves the ones before it. `--summarize` turns the
JSON files of a run into the markdown tables of the report.

Dry run on any machine (no GPU needed): `python -m bench.device.bench smollm2-135m-shape --device cpu --tiny`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import random
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.device.models import SHAPES
from bench.workload import BenchRequest, WorkloadSpec, make_workload, useful_tokens

STEP_PROMPT = 128  # prompt tokens of the step-time sequences: all decoding, ~130-170 tokens of context
PROFILE_ROWS = 12


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Report:
    """The shape's results, written to disk after every phase."""

    def __init__(self, path: Path | None, **head: Any) -> None:
        self.path, self.data = path, dict(head)

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=1, default=str))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def start_engine(loaded: Any, options: dict[str, Any]) -> tuple[Any, float]:
    from gpu.engine import Engine, EngineConfig

    start = time.perf_counter()
    engine = Engine(loaded, EngineConfig(**options))
    return engine, time.perf_counter() - start


def run_inferq(engine: Any, requests: tuple[BenchRequest, ...]) -> dict[str, float]:
    from bench.engine.contenders.inferq import engine_requests

    engine.generate(engine_requests(_warm_up(engine)))
    before = engine.stats()
    start = time.perf_counter()
    for request in engine_requests(requests):
        engine.add_request(request)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    forward = engine.stats().forward_seconds - before.forward_seconds
    return {
        "wall_s": wall,
        "tok_s": useful_tokens(requests) / wall,
        "steps": steps,
        "forward_fraction": forward / wall,
    }


def run_hf_cb(model: Any, requests: tuple[BenchRequest, ...], max_batch_tokens: int) -> dict[str, float]:
    from bench.engine.contenders.hf_cb import HfContinuousBatchingContender

    # The contender loads its model from a path; here the engine's in-memory one (HF only reads it).
    contender = HfContinuousBatchingContender.__new__(HfContinuousBatchingContender)
    contender.model, contender.max_batch_tokens, contender.page_size = model, max_batch_tokens, 256
    contender.run(tuple(BenchRequest(f"w{r.request_id}", r.prompt_token_ids, 4) for r in requests[:4]))
    result = contender.run(requests)
    return {"wall_s": result.wall_s, "tok_s": useful_tokens(requests) / result.wall_s}


def _warm_up(engine: Any) -> tuple[BenchRequest, ...]:
    return (
        BenchRequest("warm-up-0", tuple(range(3, 3 + 40)), 8),
        BenchRequest("warm-up-1", tuple(range(50, 50 + 20)), 8),
    )


def decode_steps(
    engine: Any, batch: int, steps: int, vocab: int, device: str, profile: bool, max_model_len: int
) -> dict[str, Any]:
    """Median wall time of a decode step at `batch` rows, then (profile) the same steps under the torch
    profiler: kernel time per step, launches per step, and the top kernels."""
    from bench.engine.contenders.inferq import engine_requests

    rng = random.Random(batch)
    new_tokens = min(2 * steps + 100, max_model_len - STEP_PROMPT)  # outlives timing and profiling
    requests = tuple(
        BenchRequest(f"s{batch}-{i}", tuple(rng.randrange(3, vocab) for _ in range(STEP_PROMPT)), new_tokens)
        for i in range(batch)
    )
    for request in engine_requests(requests):
        engine.add_request(request)
    started: set[str] = set()
    for _ in range(1000):  # prefill: until every sequence has its first token
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
        if len(started) == batch:
            break
    times, spans = [], _GraphSpans(engine, device)
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        assert sum(1 for o in outputs if o.new_token_ids) == batch, "the batch did not decode together"
    result: dict[str, Any] = {"step_ms": statistics.median(times) * 1000}
    result["decode_tok_s"] = batch / (result["step_ms"] / 1000)
    span = spans.close()
    if span is not None:  # without the profiler: the graph's device time from its input copies to its end
        result["graph_span_ms"], result["graph_span_fraction"] = span, span / result["step_ms"]
    if profile:
        result.update(_profile(engine, steps, device, result["step_ms"]))
    for request in requests:
        engine.abort_request(request.request_id)
    engine.step()  # let the aborts take effect
    return result


class _GraphSpans:
    """CUDA events around each decode graph's run (input copies, replay): its device time per step, a
    cross-check of the profiler's kernel time that needs no CUPTI. Records nothing off CUDA."""

    def __init__(self, engine: Any, device: str) -> None:
        step = engine.runner.cuda_step
        self.graphs = step.graphs if step is not None and device.startswith("cuda") else None
        self.events: list[tuple[Any, Any]] = []
        if self.graphs is None:
            return
        import torch

        run = self.run = self.graphs.run

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = run(*args, **kwargs)
            end.record()
            self.events.append((start, end))
            return out

        self.graphs.run = timed

    def close(self) -> float | None:
        """Median span in ms (None: no graphed step ran), the wrapper removed."""
        if self.graphs is None:
            return None
        del self.graphs.run  # the instance attribute: the class's method again
        _sync("cuda")
        spans = [start.elapsed_time(end) for start, end in self.events]
        return statistics.median(spans) if spans else None


def _profile(engine: Any, steps: int, device: str, step_ms: float) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        _sync(device)
    events = prof.key_averages()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        total_us = sum(e.self_device_time_total for e in kernels)
        top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:PROFILE_ROWS]
        rows = [
            {
                "name": e.key[:80],
                "us_per_step": e.self_device_time_total / steps,
                "calls_per_step": e.count / steps,
            }
            for e in top
        ]
        per_step_us = total_us / steps
        return {
            "kernel_us_per_step": per_step_us,
            "launches_per_step": sum(e.count for e in kernels) / steps,
            "gpu_busy_fraction": per_step_us / 1000 / step_ms,
            "profile": rows,
        }
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:PROFILE_ROWS]
    rows = [
        {"name": e.key[:80], "us_per_step": e.self_cpu_time_total / steps, "calls_per_step": e.count / steps}
        for e in top
    ]
    return {"gpu_busy_fraction": None, "profile": rows}


@contextlib.contextmanager
def _phase(report: Report, name: str) -> Iterator[None]:
    """A phase whose failure is recorded under `errors` and costs only its own row."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - reported in the JSON and the log, the shape goes on
        errors = {**report.data.get("errors", {}), name: f"{type(error).__name__}: {error}"[:500]}
        report.put("errors", errors)
        _log(f"{name} failed: {traceback.format_exc()}")


def run_shape(args: argparse.Namespace) -> int:
    import torch

    from bench.device.models import build_loaded

    report = Report(args.json, shape=args.shape, device=args.device, dtype=args.dtype, tiny=args.tiny)
    if args.device.startswith("cuda"):
        report.put("gpu", torch.cuda.get_device_name())
    start = time.perf_counter()
    loaded = build_loaded(args.shape, args.device, args.dtype, small=args.tiny)
    _sync(args.device)
    report.put("build_s", time.perf_counter() - start)
    _log(f"{args.shape}: random weights in {report.data['build_s']:.1f} s")
    options: dict[str, Any] = {
        "max_num_seqs": max(args.max_num_seqs, max(args.batches)),
        "max_num_batched_tokens": args.max_batched_tokens,
        "max_model_len": args.max_model_len,
    }
    if args.kv_cache_gib:
        options["kv_cache_memory"] = int(args.kv_cache_gib * 2**30)
    engine, startup = start_engine(loaded, options)
    step = engine.runner.cuda_step
    report.put("startup_s", startup)
    report.put("cuda_step", {
        "kernels": step.kernels.describe() if step else None,
        "start_s": step.start_seconds if step else None,
        "graphs": len(step.graphs._graphs) if step and step.graphs else 0,
        "trials": [dataclasses.asdict(t) for t in step.trials] if step else [],
    })  # fmt: skip
    cuda = {k: v for k, v in report.data["cuda_step"].items() if k != "trials"}  # trials: logged at start
    _log(f"{args.shape}: engine started in {startup:.1f} s ({cuda})")

    vocab = loaded.config.vocab_size
    requests = make_workload(WorkloadSpec(args.requests, (16, 128), (8, 256), 0), vocab)
    report.put("inferq", {"requests": len(requests), **run_inferq(engine, requests)})
    _log(f"{args.shape}: inferq {report.data['inferq']['tok_s']:,.0f} tok/s")
    # HF CB next: the reference every later phase is read against, measured before anything that may fail.
    if args.hf_requests:
        hf = run_hf_cb(loaded.model, requests[: args.hf_requests], args.max_batched_tokens)
        report.put("hf_cb", {"requests": args.hf_requests, **hf})
        report.put("x_hf_cb", report.data["inferq"]["tok_s"] / hf["tok_s"])
        _log(f"{args.shape}: HF CB {hf['tok_s']:,.0f} tok/s on {args.hf_requests} requests")

    steps: dict[str, Any] = {}
    for batch in args.batches:
        profile = batch in args.profile
        with _phase(report, f"decode_steps_{batch}"):
            steps[str(batch)] = decode_steps(
                engine, batch, args.steps, vocab, args.device, profile, args.max_model_len
            )
            report.put("decode_steps", steps)
            _log(f"{args.shape}: batch {batch}: {steps[str(batch)]['step_ms']:.2f} ms a step")

    # Last: never yet run on a GPU, so its failure (or a hang, cut by the script's timeout) costs its row.
    with _phase(report, "inferq_async"):
        engine.set_async_scheduling(True)  # the same workload with step N+1 staged while step N runs
        report.put("inferq_async", {"requests": len(requests), **run_inferq(engine, requests)})
        engine.set_async_scheduling(False)
        _log(f"{args.shape}: inferq, async scheduling {report.data['inferq_async']['tok_s']:,.0f} tok/s")
    report.put("done", True)
    return 0


def summarize(paths: list[Path]) -> str:
    """Markdown tables of the shapes' JSON files (missing phases shown as -)."""
    results = [json.loads(p.read_text()) for p in paths if p.exists()]

    def num(value: Any, spec: str = ",.0f") -> str:
        return "-" if value is None else format(value, spec)

    batches = sorted({int(b) for r in results for b in r.get("decode_steps", {})})
    lines = [
        "| shape | start-up s | graphs | inferq tok/s (requests) | async tok/s | HF CB tok/s (requests) | "
        "x HF CB | " + " | ".join(f"step ms @{b}" for b in batches) + " |",
        "|---" * (7 + len(batches)) + "|",
    ]
    for r in results:
        inferq, hf, steps = r.get("inferq", {}), r.get("hf_cb", {}), r.get("decode_steps", {})
        cells = [
            r["shape"],
            num(r.get("startup_s"), ".1f"),
            str(r.get("cuda_step", {}).get("graphs", "-")),
            f"{num(inferq.get('tok_s'))} ({inferq.get('requests', '-')})",
            num(r.get("inferq_async", {}).get("tok_s")),
            f"{num(hf.get('tok_s'))} ({hf.get('requests', '-')})",
            num(r.get("x_hf_cb"), ".1f"),
            *(num(steps.get(str(b), {}).get("step_ms"), ".2f") for b in batches),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| shape | batch | step ms | kernel us/step | launches/step | GPU busy (profiler) | graph span |",
        "|---" * 7 + "|",
    ]
    for r in results:
        for b, s in r.get("decode_steps", {}).items():
            if "profile" in s:
                lines.append(
                    f"| {r['shape']} | {b} | {s['step_ms']:.2f} | {num(s.get('kernel_us_per_step'))} | "
                    f"{num(s.get('launches_per_step'))} | {num(s.get('gpu_busy_fraction'), '.0%')} | "
                    f"{num(s.get('graph_span_fraction'), '.0%')} |"
                )
    for r in results:
        lines.append(f"\n{r['shape']}: kernels {r.get('cuda_step', {}).get('kernels')}")
        for phase, error in r.get("errors", {}).items():
            lines.append(f"\n{r['shape']}: phase {phase} FAILED: {error}")
        trials = r.get("cuda_step", {}).get("trials", [])
        if trials:
            lines += ["| kernel | chosen | triton ms | torch ms | why |", "|---|---|---|---|---|"]
            lines += [
                f"| {t['name']} | {'triton' if t['chosen'] else 'torch'} | {num(t['triton_ms'], '.4f')} | "
                f"{num(t['torch_ms'], '.4f')} | {t['reason'].replace('|', '/')} |"
                for t in trials
            ]
        for b, s in r.get("decode_steps", {}).items():
            if s.get("profile"):
                lines += [f"\nprofile, batch {b} (per step)", "| us | calls | name |", "|---|---|---|"]
                lines += [
                    f"| {p['us_per_step']:.1f} | {p['calls_per_step']:.1f} | `{p['name']}` |"
                    for p in s["profile"]
                ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.device.bench", description=__doc__)
    parser.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("--summarize", nargs="+", type=Path, metavar="JSON", help="print the tables and exit")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--tiny", action="store_true", help="2 layers, hidden 128: a dry run anywhere")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--hf-requests", type=int, default=64, help="HF CB's share of the workload (0: skip)")
    parser.add_argument("--batches", default="1,16,64,128,256", help="decode batch sizes timed")
    parser.add_argument("--profile", default="64,256", help="batch sizes also profiled")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gib", type=float, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    if args.shape is None:
        parser.error("a shape, or --summarize")
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("gpu.cuda").setLevel(logging.INFO)  # the kernel choice and the capture time
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.profile = {int(b) for b in args.profile.split(",") if b}
    return run_shape(args)


if __name__ == "__main__":
    sys.exit(main())
