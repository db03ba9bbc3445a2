"""`python -m bench.host_overhead`: the engine's host time per decode step, by phase, on the CPU.

The model's forward is replaced by a stub returning fixed logits (greedy always picks one printable
token, EOS ignored), so what is timed is what the host does around a forward: schedule, build the
inputs, sample (its argmax over the vocabulary included, shown alone as `argmax`), and turn the tokens
into outputs. Every row decodes; prefill steps are not measured. Two workloads side by side, each on its own
engine, their repetitions taking turns: every row greedy, and every row sampled (temperature, top-k, top-p,
presence/frequency/repetition penalties).

With --device-argmax the stub stands in for the CUDA step: it returns each row's argmax too, as the CUDA
decode graph does, the engine keeps penalty counts on the device as on CUDA, and the sampler's tensor
work is the stand-in device's, as the forward is (not run: a sampled row's token is the stub's): host time
is what the host does beside the device, settings built, copied and tokens read back included. The
sampler's tensor operations per step are counted in a step of their own (each at least one kernel launch
on CUDA, host time that a measurement on the CPU cannot separate from the kernels' work). The inputs are
built as on CUDA, the block table's updates logged for the device's copy: what a decode step sends is printed
beside the step's own rows up to its widest context (what a step sent before those updates).

Then the kernel launches of the CUDA step's eager prefill and mixed steps, per layer
(bench/host_overhead/launches.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from gpu.model_source import MODEL_HELP, TINY_MODEL


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", type=Path, default=None, help="result file (default: bench/results/host-overhead-*.json)"
    )
    parser.add_argument("--batch-sizes", default="64,256", help="comma-separated decode batch sizes")
    parser.add_argument(
        "--workloads",
        default="greedy,sampled",
        help="comma-separated: greedy, sampled (temperature, top-k, top-p, penalties) (default: %(default)s)",
    )
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=100, help="decode steps per repetition")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per batch size (medians reported)")
    parser.add_argument("--warmup", type=int, default=10, help="decode steps before timing")
    parser.add_argument("--model", default=TINY_MODEL, help=f"{MODEL_HELP} (default: %(default)s)")
    # The host work is one Python thread; one torch thread keeps the argmax clear of OpenMP barrier stalls
    # when other processes share the cores.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (and OMP_NUM_THREADS)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed")
    parser.add_argument(
        "--device-argmax",
        action="store_true",
        help="the stub stands in for the CUDA step and returns each row's argmax with the logits, as the "
        "decode graph does: host time is then measured, not estimated by subtracting the argmax",
    )
    parser.add_argument(
        "--no-launches", action="store_true", help="skip counting the eager steps' launches per layer"
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="forward and sampling on the engine's worker thread, overlapped with the host work",
    )


def run(args: argparse.Namespace) -> int:
    batches = tuple(int(b) for b in args.batch_sizes.split(",") if b.strip())
    if not batches or min(batches) < 1 or min(args.steps, args.reps, args.prompt_len) < 1:
        print("--batch-sizes, --steps, --reps and --prompt-len must be positive", file=sys.stderr)
        return 2
    from bench.host_overhead.steps import WORKLOADS

    workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    if not workloads or not set(workloads) <= set(WORKLOADS):
        print(f"--workloads: any of {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported, or it has no effect
    import torch

    from bench.host_overhead.steps import GREEDY, SAMPLED, measure_side_by_side, stub_engine
    from bench.machine import machine_info
    from bench.report import default_json_path, write_json

    torch.set_num_threads(args.threads)
    # Early rows decode while later ones prefill (1024 tokens a step, the decoding rows' among them): room
    # for those steps too.
    batch = max(batches)
    prefill_steps = -(-batch * args.prompt_len // max(1024 - batch, 64)) + 8
    max_context = args.prompt_len + prefill_steps + args.warmup + args.steps * args.reps + 1  # + op count
    # An engine per workload: their repetitions take turns, so the difference is measured side by side.
    engines = {
        w: stub_engine(args.model, max(batches), max_context, args.async_scheduling, args.device_argmax)
        for w in workloads
    }
    by_batch = [
        measure_side_by_side(
            {w: engine for w, (engine, _) in engines.items()}, b, args.prompt_len, args.steps, args.reps,
            args.warmup, args.seed, args.device_argmax,
        )
        for b in batches
    ]  # fmt: skip
    results = {workload: [measured[workload] for measured in by_batch] for workload in workloads}

    def each(value: Any) -> dict[str, dict[str, Any]]:
        return {w: {str(r.batch): value(r) for r in rs} for w, rs in results.items()}

    # On CUDA the greedy argmax runs on the device (inside the step's graph): what the host is left with.
    # Async scheduling: the argmax already runs on the worker thread, outside host_ms; a sampled step takes
    # no argmax.
    argmax_off = args.async_scheduling or args.device_argmax
    if GREEDY in results and SAMPLED in results:  # what sampling adds to a step of greedy rows
        # the median of each round's difference (their repetitions ran back to back): a slow spell of the
        # machine falls on both sides of a difference, not on one median
        payload_extra = {
            "sampled_minus_greedy_ms": {
                str(g.batch): statistics.median(b - a for a, b in zip(g.host_reps, s.host_reps, strict=True))
                for g, s in zip(results[GREEDY], results[SAMPLED], strict=True)
            }
        }
    else:
        payload_extra = {}
    payload = {
        "workloads": list(workloads),
        "host_ms_per_step": each(lambda r: r.host_ms),
        "host_us_per_row": each(lambda r: r.host_ms * 1000 / r.batch),
        "step_ms": each(lambda r: r.step_ms),
        "engine_cpu_ms": each(lambda r: r.engine_cpu_ms),
        "phases": each(lambda r: r.phases_ms),
        "sampler_ms": each(lambda r: r.sampler_ms),
        "sampler_ops": each(lambda r: r.sampler_ops),
        "argmax_ms": each(lambda r: r.argmax_ms),
        "host_ms_without_argmax": each(
            lambda r: r.host_ms - (0.0 if argmax_off or r.workload != GREEDY else r.argmax_ms)
        ),
        "table_update_bytes": each(lambda r: r.table_update_bytes),
        "table_rows_bytes": each(lambda r: r.table_rows_bytes),
        "decode_steps": each(lambda r: r.decode_steps),
        "tokens": each(lambda r: r.tokens),
        "forward_calls": sum(stub.calls for _, stub in engines.values()),
        **payload_extra,
        "machine": machine_info(),
        "options": {k: (str(v) if v is not None else None) for k, v in vars(args).items() if k != "func"},
    }
    for engine, _ in engines.values():
        engine.close()
    print(render(payload))
    if not args.no_launches:
        from bench.host_overhead import launches as step_launches

        launches = step_launches.count_launches(args.model)
        payload["launches"] = [dataclasses.asdict(launch) for launch in launches]
        print("\n" + step_launches.render(launches))
    path = write_json(args.json or default_json_path("host-overhead"), payload)
    print(f"\nresults: {path}")
    return 0


def render(payload: dict) -> str:
    from bench.host_overhead.steps import GREEDY
    from bench.report import format_table
    from gpu.step_clock import PHASES

    headers = [
        "workload", "batch", "host ms", "us/row", *PHASES, "(sampler)", "ops", "(argmax)", "host - argmax",
        "engine CPU ms",
    ]  # fmt: skip
    rows = [
        [
            workload,
            batch,
            host,
            payload["host_us_per_row"][workload][batch],
            *(payload["phases"][workload][batch][p] for p in PHASES),
            payload["sampler_ms"][workload][batch],
            payload["sampler_ops"][workload][batch],
            payload["argmax_ms"][workload][batch],
            payload["host_ms_without_argmax"][workload][batch],
            payload["engine_cpu_ms"][workload][batch],
        ]
        for workload in payload["workloads"]
        for batch, host in payload["host_ms_per_step"][workload].items()
    ]
    extra = payload.get("sampled_minus_greedy_ms")
    differences = ", ".join(f"batch {b} {ms:+.3f}" for b, ms in (extra or {}).items())
    added = f"sampled - greedy, host ms (median of the rounds' differences): {differences}\n" if extra else ""
    sent = payload.get("table_update_bytes", {}).get(GREEDY, {})
    if any(sent.values()):  # --device-argmax
        own = payload["table_rows_bytes"][GREEDY]
        sizes = ", ".join(f"batch {b} {sent[b]:,.0f} B (its rows: {own[b]:,.0f} B)" for b in sent)
        added += f"block table sent to the device per decode step (greedy): its updates, {sizes}\n"
    note = added + (
        "ms per decode step (medians); host = the step without the stub forward; argmax: inside sample\n"
        "sampler: its tensor work per step (inside sample), ops: the tensor operations it issues (kernel\n"
        "launches on CUDA); with --device-argmax both are the device's and host leaves the time out\n"
        "host - argmax: what stays on the host when the argmax runs on the device (CUDA: inside the graph);\n"
        "--device-argmax measures that directly: the stub returns the argmax, as the decode graph does\n"
        "async scheduling: forward and sample run on a worker thread; `forward` is the engine thread's wait "
        "for it, host leaves it (and so the argmax) out, step ms is the real rate\n"
        "engine CPU ms: the engine thread's own CPU time per step (thread_time, the bench's checks in it): "
        "what it still holds, with no wait for the worker, the GIL or other processes in it"
    )
    return format_table(headers, rows, digits=3) + "\n" + note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
