"""Structured outputs on a real GPU (skipped without one): the mask applied to CUDA logits (xgrammar's
Triton kernel) equals the CPU one, and the CUDA engine's constrained outputs validate and end by
themselves in bfloat16, decode graphs and all."""

from __future__ import annotations

import copy
import json

import pytest
import torch

# Both are project dependencies the GPU image lacks (bench/device/image.py); bench/device/carry.sh carries
# them. Without them this file skips with the reason instead of failing the device check's collection.
jsonschema = pytest.importorskip(
    "jsonschema", reason="jsonschema is not installed (carry it: bench/device/carry.sh)"
)
pytest.importorskip("xgrammar", reason="xgrammar is not installed (carry it: bench/device/carry.sh)")

from gpu.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from gpu.engine_types import GrammarSpec  # noqa: E402
from gpu.grammar.compiler import GrammarCompiler  # noqa: E402
from gpu.grammar.mask import TokenMask  # noqa: E402
from gpu.model import LoadedModel  # noqa: E402
from gpu.tokenizer import EOS_ID, ByteTokenizer  # noqa: E402
from tests.gpu.factories import greedy, make_model, make_prompts  # noqa: E402
from tests.gpu.test_grammar import MAX_TOKENS, PERSON, assert_stopped, run, sampled, schema_spec  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="this machine has no CUDA device")


def test_mask_on_cuda_logits_equals_the_cpu_mask():
    vocab = 512
    compiler = GrammarCompiler(ByteTokenizer(vocab), vocab, [EOS_ID])
    matchers = [
        (1, compiler.compile(schema_spec()).matcher()),
        (3, compiler.compile(GrammarSpec("regex", "[0-9]+")).matcher()),
    ]
    mask = TokenMask(vocab, 4)
    rows = mask.fill(matchers)
    cpu = torch.randn(4, vocab)
    for dtype in (torch.float32, torch.bfloat16):
        want, got = cpu.to(dtype), cpu.to(device="cuda", dtype=dtype)
        mask.apply(want, rows)
        mask.apply(got, rows)
        assert torch.equal(got.cpu(), want)


def test_constrained_outputs_on_cuda_validate_and_end_by_themselves():
    model = make_model()
    hf = copy.deepcopy(model.model).to(device="cuda", dtype=torch.bfloat16).eval()
    engine = Engine(
        LoadedModel(hf, hf.config, model.tokenizer, torch.device("cuda"), torch.bfloat16),
        EngineConfig(num_blocks=256),
    )
    prompts = make_prompts(8, 3, 12, seed=11)
    requests = [
        EngineRequest(
            f"g{i}", p, greedy(MAX_TOKENS) if i % 2 else sampled(i), grammar=schema_spec() if i < 6 else None
        )
        for i, p in enumerate(prompts)
    ]
    results = run(engine, requests)
    assert_stopped({k: v for k, v in results.items() if k in {f"g{i}" for i in range(6)}})
    for i in range(6):
        jsonschema.validate(json.loads(results[f"g{i}"][0]), PERSON)
