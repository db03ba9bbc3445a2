"""Where a contender's greedy tokens leave the reference's: was it a tie the arithmetic could break
either way?

Kernels that add in another order (a padded batch, a blocked matmul, a split-K attention) change fp32
logits in their last bits. Where the two best tokens are that close, greedy decoding may take either,
and everything after differs. Such a divergence is no bug, but it must be shown as what it is: at the
first differing token the reference model is run once more, on that request alone (no padding), and
the logit gap between the reference's token and the contender's is reported.
"""

from __future__ import annotations

from collections.abc import Mapping

from bench.workload import BenchRequest

# A gap this small (relative to the largest logit) is within fp32 reassociation noise for these models.
NEAR_TIE = 1e-4


def logit_gaps(
    model_spec: str | None,
    requests: tuple[BenchRequest, ...],
    reference: Mapping[str, list[int]],
    other: Mapping[str, list[int]],
    divergences: Mapping[str, int],
) -> dict[str, float]:
    """request_id -> |logit(reference's token) - logit(other's token)| / max |logit|, at the first
    divergence, by an unpadded fp32 forward of the reference's own prefix."""
    if not divergences:
        return {}
    import torch

    from bench.engine.models import load_hf_model

    model = load_hf_model(model_spec)
    prompts = {r.request_id: r.prompt_token_ids for r in requests}
    gaps: dict[str, float] = {}
    with torch.inference_mode():
        for request_id, index in divergences.items():
            ref, got = reference.get(request_id, []), other.get(request_id, [])
            if index >= len(ref) or index >= len(got):
                continue  # one stopped early: a length difference, not a token choice
            ids = torch.tensor([list(prompts[request_id]) + ref[:index]])
            logits = model(input_ids=ids).logits[0, -1].float()
            gap = (logits[ref[index]] - logits[got[index]]).abs() / logits.abs().max().clamp_min(1e-12)
            gaps[request_id] = float(gap)
    return gaps


def near_ties(gaps: Mapping[str, float]) -> int:
    return sum(gap <= NEAR_TIE for gap in gaps.values())
