"""Engine options on the command line: vLLM's names, the old names as hidden aliases, sizes, the model."""

from __future__ import annotations

import argparse

import pytest

from workers.cli.engine_options import add_engine_options, build_engine, parse_size


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    return parser.parse_args(argv)


def test_defaults_serve_smollm2_with_the_engines_own_budgets():
    args = parse()
    assert args.model == "smollm2" and args.dtype == "auto" and args.enable_prefix_caching
    assert args.kv_cache_memory is None and args.gpu_memory_utilization is None
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.block_size) == (64, 1024, 16)


def test_vllm_names_and_old_aliases_set_the_same_options():
    new = parse("--max-num-batched-tokens", "256", "--kv-cache-memory", "64MiB", "--no-enable-prefix-caching")
    old = parse("--max-batched-tokens", "256", "--kv-cache-mb", "64", "--no-prefix-caching")
    for args in (new, old):
        assert args.max_num_batched_tokens == 256 and args.kv_cache_memory == 64 * 2**20
        assert args.enable_prefix_caching is False
    assert parse("--gpu-memory-utilization", "0.5").gpu_memory_utilization == 0.5


def test_help_lists_the_model_specs_and_hides_the_aliases():
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    text = parser.format_help()
    assert "smollm2" in text and "tiny" in text and ".gguf" in text and "--kv-cache-memory SIZE" in text
    assert (
        "--kv-cache-mb" not in text
        and "--max-batched-tokens" not in text
        and "--no-prefix-caching" not in text
    )


@pytest.mark.parametrize(
    ("text", "size"),
    [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5 GB", 1_500_000_000), ("4096", 4096), ("8kib", 8192)],
)
def test_sizes_read_as_people_write_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["2G", "lots", "-1MiB", "0", "MiB"])
def test_ambiguous_or_bad_sizes_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size(text)


def test_build_engine_passes_the_budget_through():
    def blocks(size: str) -> int:
        engine = build_engine(parse("--model", "tiny", "--kv-cache-memory", size, "--block-size", "8"))
        assert engine.config.block_size == 8
        return engine.stats().kv_blocks_total

    one, two = blocks("1MiB"), blocks("2MiB")
    assert one > 0 and abs(two - 2 * one) <= 1  # the cache is sized from the given bytes
