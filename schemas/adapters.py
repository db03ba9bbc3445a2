"""Names and directories of LoRA adapters, as jobs name them in `model`: one rule for the fleet registry
(`inferq adapter add`) and a worker's own `--lora-modules`.

A name is what a job, an OpenAI request and a Batch line put in `model`, what `/v1/models` lists and what
the `jobs` row and the metrics carry. So it is short, printable, and free of what would break those
places: no spaces, no commas (vLLM's `running_lora_adapters` label joins names with commas), no `=`
(`--lora-modules NAME=DIR` splits on it). `acme/invoice-extractor`, `ft:smollm2:acme:v3` are fine.
"""

from __future__ import annotations

import re
from pathlib import Path

MAX_ADAPTER_NAME = 128
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"
_NAME = re.compile(ADAPTER_NAME_PATTERN)


def adapter_name_problem(name: str, base_names: tuple[str, ...] = ()) -> str | None:
    """Why `name` cannot name an adapter (None: it can). `base_names`: the served base model's names,
    which an adapter may not take (a job naming one means the base)."""
    if not name or len(name) > MAX_ADAPTER_NAME:
        return f"an adapter name has 1-{MAX_ADAPTER_NAME} characters, got {len(name)}"
    if not _NAME.match(name):
        return (
            f"adapter name {name!r} must start with a letter or digit and hold only letters, digits and "
            "._:/@+-"
        )
    if name in base_names:
        return f"adapter name {name!r} is a name of the served base model"
    return None


# what `peft` saves (PeftModel.save_pretrained): the engine reads these two
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def peft_directory_problem(path: Path) -> str | None:
    """Why `path` is not a PEFT adapter directory as seen from here (None: it looks like one). Only its
    form: the engine checks the contents (shapes, targets, rank, base model) when it loads it."""
    if not path.is_dir():
        return f"{path} is not a directory" if path.exists() else f"{path} does not exist"
    missing = [name for name in PEFT_FILES if not (path / name).is_file()]
    if missing:
        holds = ", ".join(PEFT_FILES)
        return f"{path} has no {' or '.join(missing)} (a PEFT adapter directory holds {holds})"
    return None
