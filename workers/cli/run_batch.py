"""`inferq run-batch`: an OpenAI Batch JSONL file in, the Batch output JSONL out, on the engine in this
process (as `vllm run-batch`). For a file and no cluster; `inferq bulk` runs files across a fleet."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from workers.cli.engine_options import add_engine_options
from workers.cli.options import add_log_options

DESCRIPTION = (
    "Read an OpenAI Batch input file (one {custom_id, method, url, body} per line, "
    "/v1/completions or /v1/chat/completions), generate every request with continuous batching in "
    "this process, and write one output line per input line, in input order: a response, or an "
    "error (invalid line, prompt too long). Bodies may carry n, logprobs/top_logprobs, penalties, "
    "logit_bias, response_format, guided_regex and guided_choice, validated as the Kafka job message; "
    "fields that change nothing (stream: false, best_of: 1, user, stream_options, ...) are accepted. "
    "Exit 0 once the file is written."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run-batch",
        help="run an OpenAI Batch file on the engine in this process (no Kafka, no database)",
        description=DESCRIPTION,
    )
    p.add_argument("-i", "--input-file", type=Path, required=True, metavar="FILE", help="Batch input JSONL")
    p.add_argument("-o", "--output-file", type=Path, required=True, metavar="FILE", help="Batch output JSONL")
    p.add_argument(
        "--errors-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="write error lines here, not in the output file (OpenAI's layout; default: one file, as vLLM)",
    )
    add_engine_options(p)
    add_log_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from workers import logs
    from workers.bulk.batch_format import read_batch, summarize
    from workers.bulk.run_batch import BatchRunner, Tally
    from workers.cli import progress_bars as progress
    from workers.cli.engine_options import build_engine, input_limits, served_model_names
    from workers.cli.lora_options import served_models
    from workers.settings import Settings

    logs.configure(args.log_level, args.log_format, f"run-batch-{os.getpid()}")
    if not args.input_file.is_file():
        print(f"inferq run-batch: no such file: {args.input_file}", file=sys.stderr)
        return 2
    settings = Settings.from_env()
    show = args.log_format == "text" and progress.wanted()
    base_names = served_model_names(args, settings)
    try:
        models = served_models(args, base_names)
        engine = build_engine(args, settings.cache_dir, show)
    except ValueError as exc:  # a bad --lora-modules adapter (gpu.lora.LoraError is a ValueError)
        print(f"inferq run-batch: {exc}", file=sys.stderr)
        return 2
    runner = BatchRunner(engine, base_names[0], input_limits(args), models=models)
    total = summarize(args.input_file, keep_errors=0).total
    tally = Tally()
    start = time.perf_counter()
    out_tmp = args.output_file.with_name(args.output_file.name + ".tmp")
    err_path = args.errors_file or args.output_file
    err_tmp = err_path.with_name(err_path.name + ".tmp")
    with (
        progress.bar("run-batch", total, enabled=show) as advance,
        open(out_tmp, "w", encoding="utf-8") as out,
    ):
        err = open(err_tmp, "w", encoding="utf-8") if args.errors_file else out  # noqa: SIM115
        try:
            for line, ok in runner.run(read_batch(args.input_file), on_answer=lambda _a: advance(1)):
                tally.add((line, ok))
                (out if ok else err).write(json.dumps(line, ensure_ascii=False) + "\n")
        finally:
            if err is not out:
                err.close()
    os.replace(out_tmp, args.output_file)  # complete files only: a crash leaves the .tmp, never half a file
    if args.errors_file:
        os.replace(err_tmp, args.errors_file)
    seconds = time.perf_counter() - start
    rate = tally.completion_tokens / max(seconds, 1e-9)
    print(f"run-batch: {tally.succeeded} succeeded, {tally.failed} failed, {tally.invalid} invalid lines; "
          f"{tally.completion_tokens} tokens in {seconds:.1f}s ({rate:.0f} tok/s); output in "
          f"{args.output_file}", file=sys.stderr)  # fmt: skip
    return 0
