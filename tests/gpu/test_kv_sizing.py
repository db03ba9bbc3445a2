"""KV cache sizing: explicit bytes, the CPU default from available RAM, the CUDA budget, and the log line."""

from __future__ import annotations

import logging

import pytest
import torch

from gpu import kv_sizing
from gpu.engine import Engine, EngineConfig
from gpu.engine_types import resolve_max_model_len
from gpu.kv_cache import KVShape
from gpu.kv_sizing import CPU_CAP_BYTES, cpu_budget, floor_blocks, plan_kv
from tests.gpu.factories import make_model

SHAPE = KVShape(num_layers=4, num_kv_heads=4, head_dim=32, block_size=16, dtype=torch.float32)  # 64 KiB/block
CPU = torch.device("cpu")


def test_block_bytes_count_k_and_v_of_every_layer():
    assert SHAPE.bytes_per_block == 2 * 4 * 16 * 4 * 32 * 4


def test_explicit_memory_and_num_blocks_win():
    plan = plan_kv(
        SHAPE, CPU, 64, 2048, kv_cache_memory=10 * SHAPE.bytes_per_block + 5, gpu_memory_utilization=0.9
    )
    assert plan.num_blocks == 10 and plan.bytes == 10 * SHAPE.bytes_per_block
    assert plan_kv(SHAPE, CPU, 64, 2048, 2**30, 0.9, num_blocks=7).num_blocks == 7
    with pytest.raises(ValueError, match="below one block"):
        plan_kv(SHAPE, CPU, 64, 2048, kv_cache_memory=100, gpu_memory_utilization=0.9)


def test_cpu_default_is_a_capped_share_of_ram_within_what_seats_can_use():
    plenty = 64 * 2**30
    # Every seat at full length needs 64 * 128 blocks = 512 MiB: no more is taken, however much RAM.
    assert cpu_budget(SHAPE, 64, 2048, plenty) == 64 * 128 * SHAPE.bytes_per_block
    wide = KVShape(30, 3, 64, 16, torch.float32)  # SmolLM2: 64 seats x 2048 tokens would be 5.6 GiB
    assert cpu_budget(wide, 64, 2048, plenty) == CPU_CAP_BYTES
    assert cpu_budget(wide, 64, 2048, 8 * 2**30) == 2 * 2**30  # a quarter of what is available
    # Never below every seat holding a short sequence, even when RAM looks scarce.
    assert cpu_budget(SHAPE, 64, 2048, 2**20) == floor_blocks(SHAPE, 64, 2048) * SHAPE.bytes_per_block


def test_cuda_budget_is_the_fraction_minus_what_is_used_and_the_activations(monkeypatch):
    total, free = 100 * 2**30, 80 * 2**30  # 20 GiB already used (weights, other processes)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    plan = plan_kv(SHAPE, torch.device("cuda"), 64, 2048, None, 0.9, activation_bytes=2**30)
    assert plan.bytes == (90 - 20 - 1) * 2**30 // SHAPE.bytes_per_block * SHAPE.bytes_per_block
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_kv(SHAPE, torch.device("cuda"), 64, 2048, None, 1.5)


def test_describe_reports_blocks_tokens_and_concurrency():
    line = kv_sizing.KVPlan(256, 256 * SHAPE.bytes_per_block, "test").describe(SHAPE, 2048)
    assert "256 blocks of 16 tokens" in line and "4,096 tokens" in line
    assert "maximum concurrency for 2,048-token requests: 2.00x" in line


def test_a_model_windowed_on_every_layer_counts_what_a_request_keeps():
    line = kv_sizing.KVPlan(256, 256 * SHAPE.bytes_per_block, "test").describe(SHAPE, 32768, 512)
    assert "4,096 tokens in the cache" in line
    assert "32,768-token requests (each holds at most 512 tokens of KV): 8.00x" in line


def test_engine_logs_the_kv_plan_and_accepts_the_old_byte_option(caplog):
    with caplog.at_level(logging.INFO, logger="gpu"):
        engine = Engine(
            make_model(), EngineConfig(kv_cache_bytes=2**20, tune_linears=False, decode_kernel="torch")
        )
    bytes_per_block = engine.runner.cache.shape.bytes_per_block
    assert engine.runner.cache.num_blocks == 2**20 // bytes_per_block
    assert any("maximum concurrency" in r.message for r in caplog.records)
    new_name = Engine(
        make_model(), EngineConfig(kv_cache_memory=2**20, tune_linears=False, decode_kernel="torch")
    )
    assert new_name.runner.cache.num_blocks == engine.runner.cache.num_blocks


def test_engine_refuses_a_token_budget_below_the_seats_before_allocating():
    with pytest.raises(ValueError, match="max_num_seqs"):
        Engine(make_model(), EngineConfig(max_num_seqs=64, max_num_batched_tokens=32, num_blocks=8))


def test_max_model_len_defaults_to_the_model_and_may_exceed_it():
    config = make_model().config
    assert resolve_max_model_len(config, None) == config.max_position_embeddings
    assert resolve_max_model_len(config, 100) == 100
    assert (
        resolve_max_model_len(config, 4 * config.max_position_embeddings)
        == 4 * config.max_position_embeddings
    )
    windowed = make_model(arch="mistral", sliding_window=64).config
    # A sliding window no longer caps the context: windowed layers read their window of the cache.
    assert resolve_max_model_len(windowed, None) == windowed.max_position_embeddings
    assert resolve_max_model_len(windowed, 300) == 300


def test_the_decode_gather_is_reserved_only_for_the_sdpa_decode_path():
    from gpu.cuda.kernels import CudaKernels
    from gpu.kv_cache import KVShape
    from gpu.runner import decode_gather_bytes

    shape = KVShape(2, 8, 128, 16, torch.bfloat16)
    sdpa = decode_gather_bytes(CudaKernels(), 256, 8192, shape, 2)
    assert sdpa == 2 * 256 * 8192 * 8 * 128 * 2
    assert decode_gather_bytes(None, 256, 8192, shape, 2) == sdpa  # CPU, or nothing chosen
    assert decode_gather_bytes(CudaKernels(decode=True), 256, 8192, shape, 2) == 0
