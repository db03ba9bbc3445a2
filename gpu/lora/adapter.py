"""A PEFT LoRA adapter read from its directory, checked against the served model, in the forward's layout.

PEFT saves `adapter_config.json` and `adapter_model.safetensors`, whose tensors are named after the base
model's modules: `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B
.weight` ([out, r]). A targeted module adds `scaling * B(A(x))` to its output, scaling = lora_alpha / r
(rsLoRA: lora_alpha / sqrt(r)), r and lora_alpha per module where `rank_pattern` / `alpha_pattern` say so.

The forward runs q|k|v and gate|up as one product each (gpu/models): an adapter's matrices for the parts of
one product are stacked, A's rows one after another and each B in its own output rows and rank columns, so
one shrink and one expand serve them all. Scaling is folded into B once, at load.

Anything the forward would not apply exactly is refused with a LoraError naming the adapter and the cause:
a missing file, DoRA, trained biases, modules_to_save, embedding or lm_head targets, a module the model
lacks, shapes of another base model, a rank over the engine's max_lora_rank.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpu.engine_types import LoraRequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGETS = ("qkv", "o", "gate_up", "down")  # the adaptable products of a layer (gpu.models.llama.Layer)

# base_model.model.<module>.lora_A[.<adapter name>].weight (PEFT drops the adapter's name when it saves)
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[^.]+)?\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.(?P<part>.+)$")


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the cause."""


@dataclass(frozen=True)
class Part:
    """One HF module of a fused product: a matrix pair of an adapter targets it."""

    module: str  # relative to a decoder layer, e.g. "self_attn.q_proj"
    in_features: int
    out_features: int
    offset: int  # its first output row in the fused product


@dataclass(frozen=True)
class ModelTargets:
    """What an adapter may target in the served model, and the shapes it must have."""

    model_type: str
    num_layers: int
    parts: dict[str, tuple[Part, ...]]  # target (TARGETS) -> its parts, in output order

    @property
    def modules(self) -> dict[str, tuple[str, int]]:
        """Module (relative to a layer) -> (target, index of the part)."""
        return {p.module: (t, i) for t, parts in self.parts.items() for i, p in enumerate(parts)}

    def out_features(self, target: str) -> int:
        return sum(p.out_features for p in self.parts[target])

    def in_features(self, target: str) -> int:
        return self.parts[target][0].in_features


def model_targets(loaded: Any) -> ModelTargets:
    """The served model's adaptable modules (gpu.models' `lora_parts`), shapes read from its first layer."""
    from gpu.models import architecture

    arch = architecture(loaded.config)
    layers = arch.text_model(loaded.model).layers
    parts: dict[str, tuple[Part, ...]] = {}
    for target, modules in arch.lora_parts().items():
        offset, found = 0, []
        for module in modules:
            linear = layers[0].get_submodule(module)
            found.append(Part(module, linear.in_features, linear.out_features, offset))
            offset += linear.out_features
        parts[target] = tuple(found)
    return ModelTargets(loaded.config.model_type, len(layers), parts)


@dataclass(frozen=True)
class LoraWeights:
    """An adapter on one product of one layer: its delta is (x @ a_t) @ b_t. Stored transposed: two plain
    row-major products on the CPU (measured faster there than through transposed views)."""

    a_t: torch.Tensor  # [in, R]: the targeted parts' A matrices as columns (R: their ranks summed)
    b_t: torch.Tensor  # [R, out]: each part's B * scaling in its rank rows and output columns, else zeros
    parts: tuple[tuple[int, int, int], ...]  # (part index, first row of R, rank): for padded slots


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest rank among its modules
    weights: dict[tuple[int, str], LoraWeights]  # (layer, target) -> weights; absent: not adapted
    # CPU: the native kernel's table of its products (gpu/lora/native.py), pointers into `weights`, which
    # this object keeps alive; None: the torch path applies it.
    table: Any = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.name, self.path)

    @property
    def nbytes(self) -> int:
        return sum(w.a_t.nbytes + w.b_t.nbytes for w in self.weights.values())


def load_adapter(
    lora: LoraRequest,
    targets: ModelTargets,
    max_rank: int,
    dtype: torch.dtype,
    pin: bool = False,
) -> LoraAdapter:
    """Read and check a PEFT directory; the weights in `dtype` on the host (pinned for fast copies to a
    GPU when `pin`). Raises LoraError."""
    where = f"adapter {lora.name!r} ({lora.path})"
    directory = Path(lora.path)
    if not directory.is_dir():
        raise LoraError(f"{where}: no such directory")
    config = _read_config(directory, where)
    base = config.get("base_model_name_or_path") or "unnamed"
    tensors = _read_tensors(directory, where)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if match is None:
            raise LoraError(
                f"{where}: tensor {name!r} is not a LoRA A or B matrix of a linear projection "
                "(embedding and lm_head LoRA, DoRA and modules_to_save are not served)"
            )
        pairs.setdefault(match["module"], {})[match["half"]] = tensor
    if not pairs:
        raise LoraError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    modules = targets.modules
    layers: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}
    rank = 0
    for module, halves in sorted(pairs.items()):
        found = _LAYER.search(module)
        if found is None or found["part"] not in modules:
            what = found["part"] if found is not None else module
            known = ", ".join(p.rsplit(".", 1)[-1] for p in modules)
            raise LoraError(
                f"{where}: targets {what!r}, which the served {targets.model_type} model does not have as "
                f"an adaptable projection (it has {known}); trained for base model {base!r}"
            )
        layer = int(found["layer"])
        if layer >= targets.num_layers:
            raise LoraError(
                f"{where}: adapts layer {layer}, the served model has {targets.num_layers} layers: "
                f"trained for another base model ({base!r})"
            )
        if set(halves) != {"A", "B"}:
            raise LoraError(f"{where}: {module} has lora_{set('AB') - set(halves)} missing")
        target, index = modules[found["part"]]
        part = targets.parts[target][index]
        a, b = halves["A"], halves["B"]
        r = a.shape[0]
        expected_a, expected_b = (r, part.in_features), (part.out_features, r)
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise LoraError(
                f"{where}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; the served model "
                f"needs {list(expected_a)} and {list(expected_b)}: trained for another base model ({base!r})"
            )
        if r > max_rank:
            raise LoraError(f"{where}: {module} has rank {r}, over this engine's max_lora_rank {max_rank}")
        rank = max(rank, r)
        layers.setdefault((layer, target), []).append((index, a, b, _scaling(config, module, r)))
    weights = {
        key: _stack(targets.parts[key[1]], targets.out_features(key[1]), found, dtype, pin)
        for key, found in layers.items()
    }
    return LoraAdapter(lora.name, lora.path, rank, weights)


def _read_config(directory: Path, where: str) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise LoraError(f"{where}: no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"{where}: {CONFIG_FILE} cannot be read: {exc}") from exc
    if not isinstance(config, dict):
        raise LoraError(f"{where}: {CONFIG_FILE} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoraError(f"{where}: a {kind} adapter; only LoRA is served")
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (whole modules trained beside LoRA)",
        "lora_bias": "trained LoRA biases",
        "layer_replication": "layer_replication",
        "trainable_token_indices": "trainable tokens",
        "use_qalora": "QA-LoRA",
    }
    for key, feature in refused.items():
        if config.get(key):
            raise LoraError(f"{where}: uses {feature}, which is not served")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{where}: trained the base model's biases (bias={config['bias']!r}), not served")
    return config


def _read_tensors(directory: Path, where: str) -> dict[str, torch.Tensor]:
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        pickled = (directory / "adapter_model.bin").is_file()
        hint = (
            " (adapter_model.bin is a pickle, never loaded: save with safe_serialization)" if pickled else ""
        )
        raise LoraError(f"{where}: no {WEIGHTS_FILE}{hint}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
        raise LoraError(f"{where}: {WEIGHTS_FILE} cannot be read: {exc}") from exc


def _pattern(patterns: dict[str, Any] | None, module: str) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module's name at its end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (alpha_pattern per module)."""
    alpha = _pattern(config.get("alpha_pattern"), module)
    if alpha is None:
        alpha = config.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _stack(
    parts: tuple[Part, ...],
    out_features: int,
    found: list[tuple[int, torch.Tensor, torch.Tensor, float]],
    dtype: torch.dtype,
    pin: bool,
) -> LoraWeights:
    """One product's A and B from its targeted parts (scaling folded into B, in float32, then rounded)."""
    found.sort(key=lambda item: item[0])
    total = sum(a.shape[0] for _, a, _, _ in found)
    a_t = torch.cat([a.float() for _, a, _, _ in found]).t().contiguous().to(dtype)
    b_t = torch.zeros(total, out_features, dtype=dtype)
    layout, row = [], 0
    for index, a, b, scaling in found:
        part, r = parts[index], a.shape[0]
        b_t[row : row + r, part.offset : part.offset + part.out_features] = (
            (b.float() * scaling).t().to(dtype)
        )
        layout.append((index, row, r))
        row += r
    if pin:
        a_t, b_t = a_t.pin_memory(), b_t.pin_memory()
    return LoraWeights(a_t, b_t, tuple(layout))
