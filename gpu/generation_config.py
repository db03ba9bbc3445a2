"""What a model's generation_config says about decoding: its sampling defaults and its EOS ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu.tokenizer import Tokenizer


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults the model's creator set in generation_config; None where it is silent.

    Callers apply a field only where the job leaves it out. Like vLLM's `get_diff_sampling_param`, only
    values that differ from transformers' own defaults count (`to_diff_dict`), and `do_sample` is not read:
    a temperature the creator set is a recommendation for sampling, whatever do_sample says.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None  # HF's max_new_tokens

    @classmethod
    def from_generation_config(cls, generation_config: Any | None) -> GenerationDefaults:
        if generation_config is None:
            return cls()
        diff = generation_config.to_diff_dict()
        return cls(
            temperature=_number(diff.get("temperature"), float),
            top_p=_number(diff.get("top_p"), float),
            top_k=_number(diff.get("top_k"), int),
            max_tokens=_number(diff.get("max_new_tokens"), int),
        )


def _number(value: Any, kind: type) -> Any:
    return None if value is None else kind(value)


def eos_token_ids(generation_config: Any | None, tokenizer: Tokenizer) -> frozenset[int]:
    """Every id that ends generation: the tokenizer's EOS and the generation_config's (an int or a list:
    Llama 3 lists <|eot_id|> and <|end_of_text|>, chat models often add their end-of-turn token)."""
    ids = set(tokenizer.eos_token_ids)
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(i) for i in eos)
    return frozenset(ids)
