"""`inferq bench ...`: benchmarks. `engine` compares the engine with HF batching on a seeded workload;
`e2e` runs jobs through Kafka, one worker and Postgres against the engine alone; `host-overhead` times the
engine's own host work per decode step with the model's forward stubbed.

Room for more verbs as further subparsers sharing bench/report.py.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    # light: argparse only; torch comes when the verb runs
    from bench import pipeline, resume
    from bench.api import load as api_load
    from bench.e2e import command as e2e
    from bench.engine import command as engine
    from bench.engine import lora
    from bench.host_overhead import command as host_overhead

    bench = subparsers.add_parser("bench", help="run a benchmark and write its results as JSON")
    bench.set_defaults(func=lambda _args: _usage(bench))
    verbs = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for name, module, summary, raw in (
        ("engine", engine, "static batching vs HF continuous batching vs inferq vs the compute floor", False),
        ("e2e", e2e, "jobs through Kafka and Postgres with one worker vs the engine alone; latencies; "
         "priority", True),
        ("pipeline", pipeline, "one-token and short jobs through Kafka, one worker and PostgreSQL, real and "
         "instant engine, vs the engine alone; CPU by thread, database round trips per job", False),
        ("lora", lora, "one workload on the base, over 4 LoRA adapters and over 16 adapters in 4 slots, "
         "ranks 8 and 16: tok/s and ratios", False),
        ("host-overhead", host_overhead, "the engine's host time per decode step by phase, forward stubbed "
         "(runs on CPU)", False),
        ("resume", resume, "a long job whose worker is killed -9 half-way: resumed from its saved tokens vs "
         "restarted from scratch, time from the kill to done", True),
        ("api-load", api_load, "2,000 requests and 500 streams at once through inferq api: the API's memory, "
         "/health latency, one jobs row a request", True),
    ):  # fmt: skip
        formatter = argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter
        parser = verbs.add_parser(name, help=summary, description=module.__doc__, formatter_class=formatter)
        module.add_arguments(parser)
        parser.set_defaults(func=module.run)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2
