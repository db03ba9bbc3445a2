"""The CUDA path: the Triton kernels or torch's SDPA and operators, chosen by measurement at engine start
(kernels.py, choice.py); decode steps replayed as CUDA graphs captured at start (graphs.py); inputs
staged through pinned host memory. Imported only when the engine runs on a CUDA device; nothing here is
needed on the CPU path, whose tests still run the step's logic on CPU tensors (capture off, Triton in its
interpreter).

Unverified until run on a GPU: bench/device_check.sh is the script that proves and measures it.
"""
