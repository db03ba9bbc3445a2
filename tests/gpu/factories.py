"""Factories for gpu tests: small seeded models, engines, requests and the HF greedy reference."""

from __future__ import annotations

import random
from typing import Any

import torch

from gpu.engine import Engine, EngineConfig, EngineRequest
from gpu.engine_types import StepFailed
from gpu.generation_config import eos_token_ids
from gpu.model import LoadedModel, build_default, default_config
from gpu.tokenizer import ByteTokenizer
from scheduler.types import SamplingParams

# Small enough for fast tests, same architecture and GQA layout as the default model.
SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
NEAR_TIE = 1e-4


def wrap(model: Any) -> LoadedModel:
    model = model.eval()
    return LoadedModel(
        model, model.config, ByteTokenizer(model.config.vocab_size), torch.device("cpu"), torch.float32
    )


_MODELS: dict[str, LoadedModel] = {}


def make_model(seed: int = 0, arch: str = "llama", **overrides: Any) -> LoadedModel:
    """A seeded model of the given architecture at a small size (cached: tests only read it)."""
    key = repr((seed, arch, sorted(overrides.items())))
    if key not in _MODELS:
        _MODELS[key] = wrap(_build(seed, arch, {**SMALL, **overrides}))
    return _MODELS[key]


def _build(seed: int, arch: str, shape: dict[str, Any]) -> Any:
    if arch == "llama":
        return build_default(default_config(**shape), seed)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


def make_engine(model: LoadedModel | None = None, **config: Any) -> Engine:
    config.setdefault("num_blocks", 256)  # the default memory budget would allocate far more per engine
    # A small token budget must still cover the seats (the scheduler refuses otherwise).
    config.setdefault("max_num_seqs", min(64, config.get("max_num_batched_tokens", 512)))
    return Engine(model or make_model(), EngineConfig(**config))


def make_prompts(
    n: int, min_len: int, max_len: int, vocab: int = 512, seed: int = 0
) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)


def make_requests(
    prompts: list[tuple[int, ...]], max_tokens: list[int], prefix: str = "r"
) -> list[EngineRequest]:
    return [
        EngineRequest(f"{prefix}{i}", p, greedy(m))
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]


@torch.inference_mode()
def hf_greedy(model: LoadedModel, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """HF generate alone, greedy; stops at any EOS id like the engine does (the EOS token is kept)."""
    device = model.device
    out = model.model.generate(
        torch.tensor([prompt], device=device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=sorted(eos_token_ids(model.model.generation_config, model.tokenizer)),
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def top2_gap(model: LoadedModel, context: list[int]) -> tuple[float, tuple[int, int]]:
    logits = model.model(torch.tensor([context], device=model.device)).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return float(top.values[0] - top.values[1]), (int(top.indices[0]), int(top.indices[1]))


def assert_matches_hf(model: LoadedModel, prompt: tuple[int, ...], got: list[int], max_tokens: int) -> None:
    """Token for token equal to HF, except a divergence at a verified near-tie (top-2 gap < 1e-4)."""
    want = hf_greedy(model, prompt, max_tokens)
    if got == want:
        return
    i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    assert i < len(got) and i < len(want), f"lengths differ without a differing token: {got} vs {want}"
    gap, pair = top2_gap(model, [*prompt, *want[:i]])
    assert gap < NEAR_TIE and {got[i], want[i]} == set(pair), (
        f"diverged at {i}: engine {got[i]} vs HF {want[i]}, top-2 {pair} gap {gap:.3g} is not a near-tie"
    )


def run_to_end(engine: Any, requests: list[EngineRequest]) -> dict[str, list]:
    """Add the requests and step to completion; every RequestOutput per request id."""
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def run_through_failures(
    engine: Engine, requests: list[EngineRequest]
) -> tuple[dict[str, list[int]], list[Exception]]:
    """Add the requests and step the engine until they finish, as a worker's loop does: a step that fails is
    recorded, its outputs kept, and stepping goes on. Returns each request's tokens and the failures: each a
    StepFailed, or the step's own RuntimeError where async scheduling raised it before the step's launch."""
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    failures: list[Exception] = []
    while engine.has_unfinished():
        try:
            outs = engine.step()
        except StepFailed as failed:
            failures.append(failed)
            outs = failed.outputs
        except RuntimeError as exc:
            failures.append(exc)
            outs = []
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
    return tokens, failures
