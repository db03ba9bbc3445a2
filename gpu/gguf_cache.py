"""A GGUF file is dequantized once into a plain safetensors checkpoint under the cache dir.

Dequantizing SmolLM2's Q4_1 GGUF takes ≈ 30 s; loading the converted checkpoint takes ≈ 2 s. The cache
entry is named by the GGUF file's SHA-256 digest, so a changed file is converted again, and it is built in
a temporary directory renamed into place when complete: a crash mid-conversion never leaves a half entry.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "inferq"  # workers pass Settings.cache_dir (INFERQ_CACHE)
_TEMP_PREFIX = ".tmp-"
_STALE_TEMP_S = 3600.0  # a conversion takes a minute at most: older temporaries were left by a crash

# Told each stage of a conversion as it begins: (what, stage number from 1, number of stages). The
# caller draws it (a progress bar, a log line); a conversion found in the cache reports nothing.
Progress = Callable[[str, int, int], None]
CONVERSION_STAGES = ("reading the tokenizer", "dequantizing the weights", "writing the checkpoint")


def file_digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def joined_gguf(parts: tuple[Path, ...], name: str, sha256: str, cache_dir: Path) -> Path:
    """A GGUF shipped in parts (several wheels), joined once into the cache and checked against its digest."""
    root = cache_dir / "models"
    target = root / name
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=root)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as chunk:
                    shutil.copyfileobj(chunk, out, 16 * 2**20)
        if file_digest(Path(temp)) != sha256:
            raise ValueError(f"{name}: the joined parts do not match sha256 {sha256}")
        os.chmod(temp, 0o644)
        os.replace(temp, target)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return target


def cached_checkpoint(gguf: Path, cache_dir: Path, progress: Progress | None = None) -> Path:
    """The checkpoint directory converted from `gguf`, converting it first if no cache entry exists."""
    root = cache_dir / "models"
    target = root / f"gguf-{file_digest(gguf)}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(root)
    log.info("converting %s into %s once (dequantizing takes a while)", gguf, target)
    start = time.perf_counter()
    temp = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=root))
    temp.chmod(0o755)  # mkdtemp makes it private; the entry is a shared cache like the Kafka jars
    try:
        convert_gguf(gguf, temp, progress)
        try:
            os.rename(temp, target)
        except OSError:
            if not target.is_dir():
                raise
            # another process finished the same conversion first: its entry is as good as ours
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    log.info("converted %s in %.1f s", gguf.name, time.perf_counter() - start)
    return target


def convert_gguf(gguf: Path, out: Path, progress: Progress | None = None) -> None:
    """Write a checkpoint `from_pretrained(out)` loads: fp32 weights, config, generation config, tokenizer.

    transformers refuses `save_pretrained` on a GGUF-loaded model, so the parts are written one by one.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def stage(index: int) -> None:
        if progress is not None:
            progress(CONVERSION_STAGES[index], index + 1, len(CONVERSION_STAGES))

    options: dict[str, Any] = dict(gguf_file=gguf.name, local_files_only=True)
    stage(0)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **options)
    stage(1)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **options)
    stage(2)
    save_file(_unshared(model.state_dict()), out / "model.safetensors", metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are plain now; kept, it would ask for the GGUF again
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _publishable(out)


def _unshared(state: dict[str, Any]) -> dict[str, Any]:
    """Each tensor once: tied weights (lm_head = embed_tokens) share storage, which safetensors refuses;
    from_pretrained ties them again from the config."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor.contiguous()
    return out


def _publishable(directory: Path) -> None:
    """Readable by all like the rest of the cache, and on disk before the rename publishes them."""
    for path in directory.iterdir():
        path.chmod(0o644)
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _remove_stale_temporaries(root: Path) -> None:
    now = time.time()
    for entry in root.glob(f"{_TEMP_PREFIX}*"):
        try:
            if now - entry.stat().st_mtime > _STALE_TEMP_S:
                shutil.rmtree(entry, ignore_errors=True)
        except FileNotFoundError:
            pass  # another process removed it
