"""LoRA options of the engine's commands (`worker`, `run-batch`), under vLLM's names: a worker's own adapters
(`--lora-modules NAME=DIR ...`), checked at start, and the engine's adapter budgets."""

from __future__ import annotations

import argparse
from pathlib import Path

from schemas.adapters import adapter_name_problem, peft_directory_problem


def lora_module(text: str) -> tuple[str, Path]:
    """`NAME=DIR` → (name, absolute directory), or the reason it cannot be one (argparse prints it)."""
    name, sep, directory = text.partition("=")
    if not sep or not directory:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DIR")
    path = Path(directory).expanduser().absolute()
    problem = adapter_name_problem(name) or peft_directory_problem(path)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return name, path


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def add_lora_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "LoRA adapters",
        "A job names an adapter in `model`: one of --lora-modules (every tenant's), or one of the fleet's "
        "registry (`inferq adapter add`), loaded on the first job that names it.",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=lora_module,
        default=[],
        metavar="NAME=DIR",
        help="this worker's own adapters: PEFT directories (adapter_config.json, adapter_model.safetensors), "
        "loaded and checked at start (a bad one stops the command with the reason); a name here wins over "
        "the registry's",
    )
    g.add_argument(
        "--max-loras",
        type=_positive,
        default=4,
        metavar="N",
        help="distinct adapters in one step at most, their weights resident in the engine (least recently "
        "used swap out) (default: 4)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=_positive,
        default=16,
        metavar="R",
        help="the highest rank served (default: 16)",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=_positive,
        default=None,
        metavar="N",
        help="adapters kept loaded in host memory (least recently used out) (default: the engine's)",
    )


def lora_engine_options(args: argparse.Namespace) -> dict:
    """The options' EngineConfig fields."""
    return {name: getattr(args, name) for name in ("max_loras", "max_lora_rank", "max_cpu_loras")}


def load_lora_modules(engine, args: argparse.Namespace) -> None:
    """Load and check each --lora-modules adapter in the engine now; raises gpu.lora.LoraError naming the
    adapter and the cause (the command stops at start)."""
    from gpu.engine_types import LoraRequest

    for name, path in getattr(args, "lora_modules", ()):
        engine.load_lora(LoraRequest(name, str(path)))


def served_models(args: argparse.Namespace, base_names: tuple[str, ...]):
    """What jobs may name: the base's names and the --lora-modules adapters. Raises ValueError for an
    adapter named twice or by a name of the base (checked before the model loads)."""
    from gpu.engine_types import LoraRequest
    from workers.serving.admission.models import ServedModels

    own: dict[str, LoraRequest] = {}
    for name, path in args.lora_modules:
        problem = adapter_name_problem(name, base_names)
        if problem is None and name in own:
            problem = f"adapter {name!r} is given twice"
        if problem is not None:
            raise ValueError(f"--lora-modules {name}={path}: {problem}")
        own[name] = LoraRequest(name, str(path))
    return ServedModels(base_names, own)
