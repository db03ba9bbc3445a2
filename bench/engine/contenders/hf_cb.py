"""`hf_cb`: transformers' own continuous batching manager, with per-request `max_new_tokens`."""

from __future__ import annotations

import time

from bench.engine.contenders import RunResult, placed
from bench.engine.models import load_hf_model
from bench.workload import BenchRequest

RESULT_TIMEOUT_S = 600.0  # a stuck manager fails the run instead of hanging the benchmark


class HfContinuousBatchingContender:
    name = "hf_cb"

    def __init__(
        self,
        model_path: str | None,
        max_batch_tokens: int = 256,
        page_size: int = 256,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        self.model = placed(load_hf_model(model_path), device, dtype)
        self.max_batch_tokens = max_batch_tokens
        self.page_size = page_size

    def warm_up(self, requests: tuple[BenchRequest, ...]) -> None:
        self.run(requests)

    def run(self, requests: tuple[BenchRequest, ...]) -> RunResult:
        import torch
        from transformers import ContinuousBatchingConfig, GenerationConfig

        longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests)
        pages_per_request = -(-longest // self.page_size)
        cb_config = ContinuousBatchingConfig(
            max_batch_tokens=self.max_batch_tokens,
            page_size=self.page_size,
            num_blocks=pages_per_request * len(requests) + 8,  # room for every request at once
        )
        generation_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max(r.max_new_tokens for r in requests),
            eos_token_id=-1,  # EOS off: every request runs to its own max_new_tokens
            pad_token_id=0,
        )
        tokens: dict[str, list[int]] = {}
        # Manager start and shutdown (≈0.5 s) stay outside the timed region.
        with (
            torch.inference_mode(),
            self.model.continuous_batching_context_manager(
                generation_config=generation_config, continuous_batching_config=cb_config, block=True
            ) as manager,
        ):
            start, cpu_start = time.perf_counter(), time.process_time()
            for request in requests:
                manager.add_request(
                    list(request.prompt_token_ids),
                    request_id=request.request_id,
                    max_new_tokens=request.max_new_tokens,
                )
            while len(tokens) < len(requests):
                result = manager.get_result(timeout=RESULT_TIMEOUT_S)
                if result is None:
                    raise RuntimeError(
                        f"hf_cb: manager stopped with {len(requests) - len(tokens)} requests open"
                    )
                if result.error:
                    raise RuntimeError(f"hf_cb: request {result.request_id} failed: {result.error}")
                if result.is_finished():
                    tokens[result.request_id] = list(result.generated_tokens)
            wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        return RunResult(wall_s=wall_s, cpu_s=cpu_s, tokens=tokens)
