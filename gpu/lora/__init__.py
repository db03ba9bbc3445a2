"""LoRA adapters on the served model, many mixed in one batch (Punica's SGMV idea, S-LoRA's host cache).

- `adapter.py`: a PEFT directory read and checked against the model, in the forward's layout (LoraError);
- `host_cache.py`: loaded adapters in host memory by (name, path), least recently used out;
- `rows.py`: a step's rows grouped by adapter, and the CPU's shrink and expand per group;
- `slots.py`: max_loras adapters resident in stacked, rank-padded device weights, for the Triton kernels
  (gpu/triton_kernels/lora.py) and the decode CUDA graphs;
- `manager.py`: the engine's view of all that.
"""

from gpu.lora.adapter import LoraError

__all__ = ["LoraError"]
