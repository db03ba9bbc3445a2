"""`inferq bench ...`: benchmarks. `engine` compares the engine with HF batching on a seeded workload;
`e2e` runs jobs through Kafka, one worker and Postgres against the engine alone; `host-overhead` times the
engine's own host work per decode step with the model's forward stubbed.

Room for more verbs as further subparsers sharing bench/report.py.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from bench import e2e, engine, host_overhead  # light: argparse only; torch comes when the verb runs

    bench = subparsers.add_parser("bench", help="run a benchmark and write its results as JSON")
    bench.set_defaults(func=lambda _args: _usage(bench))
    verbs = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    engine_parser = verbs.add_parser(
        "engine",
        help="static batching vs HF continuous batching vs inferq vs the compute floor",
        description=engine.__doc__,
    )
    engine.add_arguments(engine_parser)
    engine_parser.set_defaults(func=engine.run)
    e2e_parser = verbs.add_parser(
        "e2e",
        help="jobs through Kafka and Postgres with one worker vs the engine alone; latencies; priority",
        description=e2e.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e2e.add_arguments(e2e_parser)
    e2e_parser.set_defaults(func=e2e.run)
    host_parser = verbs.add_parser(
        "host-overhead",
        help="the engine's host time per decode step by phase, forward stubbed (runs on CPU)",
        description=host_overhead.__doc__,
    )
    host_overhead.add_arguments(host_parser)
    host_parser.set_defaults(func=host_overhead.run)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2
