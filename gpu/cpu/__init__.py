"""The CPU path's own pieces, as gpu/cuda/ holds the CUDA path's: the linear kernels and their per-shape
choice (linear.py, panel_linear.py), the RoPE + cache write and paged decode through native C kernels
(rope_write.py, native_decode.py; sources and their build in native/), the kernel choices measured at
engine start (autotune.py) and the forward's thread count (threads.py). Each falls back to the portable
torch path where its kernel cannot be built or loses; on CUDA none of it runs.
"""
