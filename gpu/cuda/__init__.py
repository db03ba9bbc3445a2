"""The CUDA path: attention through torch SDPA, decode steps replayed as CUDA graphs at bucketed batch
sizes, inputs staged through pinned host memory. Imported only when the engine runs on a CUDA device;
nothing here is needed (or importable without a GPU being usable) on the CPU path.

Unverified until run on a GPU: bench/device_check.sh is the script that proves it.
"""
