"""Building the engine from the command line: its options (shared by `worker` and `run-batch`), the
model conversion on first use, and a warm-up before serving."""

from __future__ import annotations

import argparse
import logging
import re
import time
from pathlib import Path

from workers.cli.lora_options import add_lora_options, load_lora_modules, lora_engine_options
from workers.cli.options import HIDDEN

log = logging.getLogger(__name__)


# Sizes as people write them; bare K/M/G are refused rather than guessed (decimal or binary?).
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_size(text: str) -> int:
    """Bytes from `512MiB`, `2GiB`, `1.5GB` or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) * _SIZE_UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, or bytes)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _mib(text: str) -> int:
    return int(text) * 2**20


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine's options under vLLM's names; the old names still work (hidden aliases)."""
    from gpu.model_source import DEFAULT_MODEL, MODEL_HELP

    hidden = HIDDEN
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"{MODEL_HELP} (default: %(default)s)")
    g.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the name responses and metrics carry (default: INFERQ_SERVED_MODEL_NAME, else --model)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV cache; auto: float32 on CPU, bfloat16 on CUDA (default: auto)",
    )
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    g.add_argument(
        "--max-num-seqs", type=int, default=64, help="running sequences per step at most (default: 64)"
    )
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=1024, help="tokens per step at most (default: 1024)"
    )
    g.add_argument("--max-batched-tokens", dest="max_num_batched_tokens", type=int, **hidden)
    g.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="KV cache budget, e.g. 512MiB or 2GiB (default: the engine's)",
    )
    g.add_argument("--kv-cache-mb", dest="kv_cache_memory", type=_mib, **hidden)
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FLOAT",
        help="share of GPU memory the KV cache may fill, 0-1 (default: the engine's)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of shared prompt prefixes",
    )
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", **hidden)
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="schedule and stage step N+1 while step N runs (default: off; see docs/architecture.md)",
    )
    g.add_argument(
        "--allow-special-tokens",
        action="store_true",
        help="parse control tokens spelt in prompts and messages (e.g. <|im_start|>) as control tokens; "
        "by default they stay plain text, so users cannot forge chat roles",
    )
    add_lora_options(parser)
    g.add_argument(
        "--max-tokens",
        dest="max_tokens_cap",
        type=int,
        default=None,
        metavar="N",
        help="a cap on a job's max_tokens: more is refused, and a job naming none gets up to N "
        "(default: no cap; a job naming none generates up to the context left after its prompt)",
    )


def input_limits(args: argparse.Namespace):
    """The validation limits the options ask for (the defaults but for control tokens in text)."""
    from schemas.validation import Limits

    cap = getattr(args, "max_tokens_cap", None)
    if cap is not None and cap < 1:
        raise SystemExit(f"--max-tokens must be at least 1, got {cap}")
    return Limits(special_tokens_in_text=args.allow_special_tokens, max_tokens=cap)


def served_model_name(args: argparse.Namespace, settings) -> str:
    return args.served_model_name or settings.served_model_name or args.model


def served_model_names(args: argparse.Namespace, settings) -> tuple[str, ...]:
    """The names a job's `model` may give for the base (comma-separated, as INFERQ_SERVED_MODEL_NAME
    is for the API); the first is the one rows, responses and metrics carry."""
    names = tuple(n.strip() for n in served_model_name(args, settings).split(",") if n.strip())
    return names or (args.model,)


def convert_model(spec: str, cache_dir: Path | None, show_progress: bool) -> None:
    """A GGUF model's one-off conversion, done here so a person sees it progress (the engine then finds
    the cache entry); nothing for other models or an entry already converted."""
    from gpu.gguf_cache import DEFAULT_CACHE_DIR, cached_checkpoint
    from gpu.model_source import SourceKind, resolve_model
    from workers.cli import progress_bars as progress

    source = resolve_model(spec)
    if source.kind is SourceKind.GGUF and source.path is not None:
        with progress.stages(f"converting {source.path.name} once", enabled=show_progress) as report:
            cached_checkpoint(source.path, cache_dir or DEFAULT_CACHE_DIR, report)


def build_engine(args: argparse.Namespace, cache_dir: Path | None = None, show_progress: bool = False):
    """The engine the options describe; a GGUF model is converted into `cache_dir` on first use."""
    from gpu.engine import Engine

    options = dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        async_scheduling=getattr(args, "async_scheduling", False),
        **lora_engine_options(args),
    )
    # Only when given, so the engine's own defaults (and their sizing rules) apply otherwise.
    if args.kv_cache_memory is not None:
        options["kv_cache_memory"] = args.kv_cache_memory
    if args.gpu_memory_utilization is not None:
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    start = time.perf_counter()
    convert_model(args.model, cache_dir, show_progress)
    engine = Engine.from_options(
        model=args.model, dtype=args.dtype, device=args.device, cache_dir=cache_dir, **options
    )
    log.info("model %s ready in %.1f s", args.model, time.perf_counter() - start)
    load_lora_modules(engine, args)  # in the engine's own process: a bad adapter stops it from starting
    return engine


def build_warm_engine(
    args: argparse.Namespace, cache_dir: Path | None, failpoint: str = "", worker_id: str | None = None
):
    """The engine of `--engine-process`, made and warmed up in its own process (so: module level, its
    arguments picklable); its logs go out as the worker's (`worker_id`), and the step failpoints are set
    there, reading the prompts the engine holds."""
    from workers import logs
    from workers.serving.failpoints import step_fault

    if worker_id is not None:
        logs.configure(args.log_level, args.log_format, worker_id)
    engine = build_engine(args, cache_dir)
    engine.fault_hook = step_fault(
        failpoint, lambda rid: engine.tokenizer.decode(engine.prompt_token_ids(rid))
    )
    warm_up(engine)
    return engine


def warm_up(engine) -> None:
    """Run a prefill and a few decode steps before joining the group: the first steps of a process pay
    one-off costs (allocations, kernel selection) that would otherwise land on the first real job's TTFT."""
    from gpu.engine import EngineRequest
    from scheduler.types import SamplingParams

    prompt = tuple(engine.tokenizer.encode("warm-up " * 16))
    engine.generate([EngineRequest("inferq-warm-up", prompt, SamplingParams(max_tokens=4, ignore_eos=True))])
