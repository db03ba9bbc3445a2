"""The engine benchmark (`inferq bench engine`): the engine against HF batching on a seeded workload,
and the engine's micro-benchmarks (kernels, n samples, structured outputs, windowed KV)."""
