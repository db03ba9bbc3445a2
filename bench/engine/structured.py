"""`python -m bench.engine.structured`: what JSON-schema constraints cost the engine, on the tiny model.

One batch, half of its jobs constrained by a JSON schema (greedy and sampled alike), is run against the
same batch with no constraint, in alternating repetitions within one run. Both runs produce the same
tokens per job: the constrained run goes first, and each job of the free run is told to make exactly as
many tokens as its twin made (EOS ignored), so the two differ only in the grammar work: the mask filled
and applied for the constrained rows, and each accepted token advanced through its matcher. Grammars are
compiled before the clock starts, as the worker's intake thread does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gpu.model_source import MODEL_HELP, TINY_MODEL

SCHEMAS: tuple[dict[str, Any], ...] = (
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 24},
            "servings": {"type": "integer", "minimum": 1, "maximum": 12},
            "steps": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
            "difficulty": {"enum": ["easy", "medium", "hard"]},
        },
        "required": ["title", "servings", "steps", "difficulty"],
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "number", "minimum": -1, "maximum": 1},
                    "y": {"type": "number", "minimum": -1, "maximum": 1},
                },
                "required": ["x", "y"],
            },
            "label": {"enum": ["a", "b", "c"]},
            "ok": {"type": "boolean"},
        },
        "required": ["point", "label", "ok"],
    },
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", type=Path, default=None, help="result file (default: bench/results/structured-*.json)"
    )
    parser.add_argument("--requests", type=int, default=32, help="jobs in the batch")
    parser.add_argument("--constrained", type=float, default=0.5, help="fraction of jobs with a schema")
    parser.add_argument("--prompt-len", default="16:64", metavar="MIN:MAX", help="prompt tokens, uniform")
    parser.add_argument("--free-len", type=int, default=128, help="tokens each unconstrained job makes")
    parser.add_argument("--max-tokens", type=int, default=400, help="a constrained job's limit")
    parser.add_argument("--reps", type=int, default=5, help="alternating repetitions of each run")
    parser.add_argument("--model", default=TINY_MODEL, help=f"{MODEL_HELP} (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (and OMP_NUM_THREADS)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")


def run(args: argparse.Namespace) -> int:
    low, high = (int(v) for v in args.prompt_len.split(":"))
    if min(args.requests, args.reps, low, args.free_len, args.max_tokens) < 1 or high < low:
        print(
            "--requests, --reps, --prompt-len, --free-len and --max-tokens must be positive", file=sys.stderr
        )
        return 2
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported, or it has no effect
    import torch

    from bench.machine import machine_info
    from bench.report import default_json_path, progress, write_json
    from gpu.engine import Engine
    from gpu.engine_types import GrammarSpec

    torch.set_num_threads(args.threads)
    engine = Engine.from_options(
        args.model, device=args.device, max_num_seqs=max(args.requests, 1), num_blocks=None
    )
    rng = random.Random(args.seed)
    vocab = min(engine.model.config.vocab_size, 259 if args.model == TINY_MODEL else 10**9)
    prompts = [
        tuple(rng.randrange(3, vocab) for _ in range(rng.randint(low, high))) for _ in range(args.requests)
    ]
    count = round(args.requests * args.constrained)
    specs = [GrammarSpec("json_schema", json.dumps(SCHEMAS[i % len(SCHEMAS)])) for i in range(count)]
    start = time.perf_counter()
    engine.compile_grammar(GrammarSpec("regex", "x"))  # loads xgrammar and the vocabulary, once per engine
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    grammars = [engine.compile_grammar(spec) for spec in specs] + [None] * (args.requests - count)
    compile_s = time.perf_counter() - start
    rng.shuffle(grammars)
    job = Workload(prompts, grammars, args)
    lengths = job.run(engine, None)["tokens"]  # warm-up, and each job's length for the free twin
    runs: dict[str, list[dict[str, Any]]] = {"constrained": [], "free": []}
    for rep in range(args.reps):
        for name in runs:
            progress(f"rep {rep + 1}/{args.reps}: {name}")
            runs[name].append(job.run(engine, lengths if name == "free" else None))
    payload = summarize(runs, job, lengths, compile_s)
    payload["grammar_setup_s"] = setup_s
    payload["machine"] = machine_info()
    payload["options"] = {k: str(v) for k, v in vars(args).items() if k != "func"}
    print(render(payload))
    path = write_json(args.json or default_json_path("structured"), payload)
    print(f"\nresults: {path}")
    return 0


class Workload:
    def __init__(self, prompts: list[tuple[int, ...]], grammars: list[Any], args: argparse.Namespace) -> None:
        self.prompts, self.grammars, self.args = prompts, grammars, args

    def requests(self, lengths: list[int] | None) -> list[Any]:
        """lengths None: the constrained batch; otherwise the free batch, each job making that many tokens."""
        from gpu.engine import EngineRequest
        from scheduler.types import SamplingParams

        requests = []
        for i, (prompt, grammar) in enumerate(zip(self.prompts, self.grammars, strict=True)):
            if lengths is not None:
                max_tokens, grammar = lengths[i], None
            else:
                max_tokens = self.args.max_tokens if grammar is not None else self.args.free_len
            # Half greedy, half sampled; the seed fixes a job's draws, so both runs see the same tokens
            # wherever the grammar allows them.
            sampling = SamplingParams(
                max_tokens=max_tokens, temperature=0.8 * (i % 2), seed=i, ignore_eos=True
            )
            requests.append(EngineRequest(f"j{i}", prompt, sampling, grammar=grammar))
        return requests

    def run(self, engine: Any, lengths: list[int] | None) -> dict[str, Any]:
        requests = self.requests(lengths)
        clock_before, steps_before = engine.clock.snapshot(), engine.clock.steps
        tokens = dict.fromkeys((r.request_id for r in requests), 0)
        finished: dict[str, str] = {}
        start = time.perf_counter()
        for request in requests:
            engine.add_request(request)
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += len(out.new_token_ids)
                if out.finish_reason is not None:
                    finished[out.request_id] = out.finish_reason.value
        wall = time.perf_counter() - start
        phases = {k: v - clock_before[k] for k, v in engine.clock.snapshot().items()}
        return {
            "wall_s": wall,
            "tokens": [tokens[r.request_id] for r in requests],
            "finish": [finished[r.request_id] for r in requests],
            "steps": engine.clock.steps - steps_before,
            "phases_s": phases,
        }


def summarize(
    runs: dict[str, list[dict[str, Any]]], job: Workload, lengths: list[int], compile_s: float
) -> dict:
    constrained = [i for i, g in enumerate(job.grammars) if g is not None]
    out: dict[str, Any] = {"runs": runs, "compile_s": compile_s, "constrained_jobs": len(constrained)}
    summary = {}
    for name, reps in runs.items():
        wall = statistics.median(r["wall_s"] for r in reps)
        tokens = sum(reps[0]["tokens"])
        steps = statistics.median(r["steps"] for r in reps)
        summary[name] = {
            "wall_s": wall,
            "tokens": tokens,
            "tok_s": tokens / wall,
            "steps": steps,
            "ms_per_step": wall / steps * 1000,
            "phase_ms_per_step": {
                p: statistics.median(r["phases_s"][p] / r["steps"] * 1000 for r in reps)
                for p in reps[0]["phases_s"]
            },
        }
    out["summary"] = summary
    out["overhead"] = summary["constrained"]["wall_s"] / summary["free"]["wall_s"] - 1
    # Steadier on a shared machine: the grammar work happens in the sample phase (mask) and the outputs
    # phase (matcher advance), so their growth over the free run, against the free run's step, is its cost
    # without the forward's noise.
    c, f = summary["constrained"]["phase_ms_per_step"], summary["free"]["phase_ms_per_step"]
    grammar_ms = sum(c[p] - f[p] for p in ("sample", "outputs"))
    out["grammar_ms_per_step"] = grammar_ms
    out["host_overhead"] = grammar_ms / summary["free"]["ms_per_step"]
    out["same_tokens"] = all(r["tokens"] == lengths for rs in runs.values() for r in rs)
    out["constrained_stopped"] = all(
        r["finish"][i] == "stop" for r in runs["constrained"] for i in constrained
    )
    out["constrained_tokens"] = [lengths[i] for i in constrained]
    return out


def render(payload: dict) -> str:
    from bench.report import format_table
    from gpu.step_clock import PHASES

    headers = ["run", "wall s", "tokens", "tok/s", "steps", "ms/step", *(f"{p} ms" for p in PHASES)]
    rows = [
        [
            name,
            s["wall_s"],
            s["tokens"],
            s["tok_s"],
            s["steps"],
            s["ms_per_step"],
            *(s["phase_ms_per_step"][p] for p in PHASES),
        ]
        for name, s in payload["summary"].items()
    ]
    lengths = payload["constrained_tokens"]
    notes = [
        f"overhead of the constrained run: {payload['overhead']:+.1%} wall time (bar: +15%); "
        f"grammar work in sample + outputs: {payload['grammar_ms_per_step']:.2f} ms/step, "
        f"{payload['host_overhead']:+.1%} of a free step",
        f"{payload['constrained_jobs']} jobs with a JSON schema, {min(lengths)}-{max(lengths)} tokens each, "
        f"all ended by their grammar: {payload['constrained_stopped']}; "
        f"same tokens per job in both runs: {payload['same_tokens']}",
        f"before the clock: grammar compiler made in {payload['grammar_setup_s'] * 1000:.0f} ms, "
        f"the batch's {len(lengths)} schemas ({len(SCHEMAS)} distinct) compiled in "
        f"{payload['compile_s'] * 1000:.1f} ms",
        "medians over the repetitions; phases per step: the mask lands in sample, matcher advance in outputs",
    ]
    return format_table(headers, rows, digits=2) + "\n" + "\n".join(notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.structured", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
