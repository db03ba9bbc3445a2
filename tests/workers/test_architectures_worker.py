"""Through Kafka: `inferq worker --model DIR` on random-weight checkpoints of the new architectures (saved by
save_pretrained, no tokenizer files: the byte tokenizer) answers a prompt longer than the sliding window with
HF `generate`'s greedy tokens, beside shorter jobs in the same batch."""

from __future__ import annotations

import uuid

import pytest
import torch

from gpu.model import load_model
from tests.gpu.factories import make_model
from tests.gpu.test_gold_architectures import ARCHITECTURES, WINDOW
from tests.workers.worker_factories import serving_worker

pytestmark = [pytest.mark.services, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 12


def hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("name", ["qwen3-window", "phi3-window", "gemma3_text", "mistral-window"])
def test_worker_serves_the_checkpoint_like_hf(settings, tmp_path, name):
    checkpoint = tmp_path / name
    make_model(seed=21, **ARCHITECTURES[name]).model.save_pretrained(checkpoint)
    loaded = load_model(str(checkpoint), "float32", "cpu")  # the worker's own reading of the directory
    prompts = ["windows " * 6 + "end", "short", "a prompt of medium length"]
    assert len(loaded.tokenizer.encode(prompts[0])) > 4 * WINDOW
    worker_args = ("--model", str(checkpoint))
    with serving_worker(settings, tmp_path, f"arch-{name}", *worker_args) as (_dep, client, _db, worker):
        run = uuid.uuid4().hex[:8]  # job ids are the database's: a rerun must not find them done
        jobs = [
            client.submit(
                {"job_id": f"{name}-{run}-{i}", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}
            )
            for i, p in enumerate(prompts)
        ]
        for i, (submitted, prompt) in enumerate(zip(jobs, prompts, strict=True)):
            result = client.wait(submitted, timeout_s=300)
            assert result.status == "succeeded", (result, worker.output()[-2000:])
            want = hf_greedy(loaded.model, loaded.tokenizer.encode(prompt))
            assert result.usage.completion_tokens == len(want), (i, result.usage, want)
            assert result.output_text == loaded.tokenizer.decode(want), (i, want)
