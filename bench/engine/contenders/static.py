"""`static`: HF `generate` over fixed groups in arrival order, each group run to its longest request."""

from __future__ import annotations

import time

from bench.engine.contenders import RunResult, placed
from bench.engine.models import load_hf_model
from bench.workload import BenchRequest

PAD_ID = 0  # any id works: padded positions are masked out by the attention mask


class StaticContender:
    name = "static"

    def __init__(
        self, model_path: str | None, group_size: int = 16, device: str = "cpu", dtype: str = "float32"
    ) -> None:
        self.model = placed(load_hf_model(model_path), device, dtype)
        # EOS off without min_new_tokens: masking the EOS logit would change greedy tokens vs the others
        self.model.generation_config.eos_token_id = None
        self.group_size = group_size

    def warm_up(self, requests: tuple[BenchRequest, ...]) -> None:
        self.run(requests)

    def run(self, requests: tuple[BenchRequest, ...]) -> RunResult:
        import torch

        tokens: dict[str, list[int]] = {}
        start, cpu_start = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            for offset in range(0, len(requests), self.group_size):
                tokens.update(self._run_group(requests[offset : offset + self.group_size]))
        wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        return RunResult(wall_s=wall_s, cpu_s=cpu_s, tokens=tokens)

    def _run_group(self, group: tuple[BenchRequest, ...]) -> dict[str, list[int]]:
        import torch

        width = max(len(r.prompt_token_ids) for r in group)
        longest = max(r.max_new_tokens for r in group)
        input_ids = torch.full((len(group), width), PAD_ID, dtype=torch.long)
        attention_mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, request in enumerate(group):  # left padding: every prompt ends at the last column
            length = len(request.prompt_token_ids)
            input_ids[row, width - length :] = torch.tensor(request.prompt_token_ids)
            attention_mask[row, width - length :] = 1
        output = self.model.generate(
            input_ids=input_ids.to(self.model.device),
            attention_mask=attention_mask.to(self.model.device),
            do_sample=False,
            max_new_tokens=longest,
            pad_token_id=PAD_ID,
        )
        generated = output[:, width:]
        # Only what each request asked for counts; a short group output shows up in the length check.
        return {r.request_id: generated[row, : r.max_new_tokens].tolist() for row, r in enumerate(group)}
