"""The pure parts of reading compressed batches: every codec's decompression bound."""

from __future__ import annotations

import time

import kafka.codec
import kafka.record.default_records as default_records
import pytest

from workers.kafka_io.codec import (
    DecompressedTooLarge,
    bounded_decoder,
    decompression_bound,
    install_bounds,
)

TEXT = b"the same words again and again " * 100_000  # 3.1 MB that compresses well under every codec

ENCODERS = {
    "gzip": kafka.codec.gzip_encode,
    "snappy": kafka.codec.snappy_encode,  # the xerial framing, as the Java client writes it
    "snappy-raw": lambda data: kafka.codec.snappy_encode(data, xerial_compatible=False),  # as franz-go
    "lz4": kafka.codec.lz4_encode,
    "zstd": kafka.codec.zstd_encode,
}


@pytest.mark.parametrize("codec", sorted(ENCODERS))
def test_every_codec_is_inflated_only_up_to_the_bound(codec):
    payload = ENCODERS[codec](TEXT)
    assert len(payload) < len(TEXT) // 10
    decode = bounded_decoder(codec.removesuffix("-raw"), 4 * 2**20)
    assert decode(payload) == TEXT
    with pytest.raises(DecompressedTooLarge):
        bounded_decoder(codec.removesuffix("-raw"), 2**20)(payload)


def test_a_snappy_block_that_claims_gigabytes_is_refused_before_it_is_inflated():
    # a raw snappy block states its length first (varint): here 4 GiB - 1, which a decoder would allocate
    bomb = b"\xff\xff\xff\xff\x0f" + kafka.codec.snappy_encode(b"x", xerial_compatible=False)[1:]
    started = time.monotonic()
    with pytest.raises(DecompressedTooLarge):
        bounded_decoder("snappy", 64 * 2**20)(bomb)
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_kafka_python_decodes_every_codec_through_the_bound_in_force(codec):
    install_bounds()
    payload = ENCODERS[codec](TEXT)
    decode = getattr(default_records, f"{codec}_decode")
    assert decode(payload) == TEXT  # the default bound (64 MiB)
    with decompression_bound(2**20), pytest.raises(DecompressedTooLarge):
        decode(payload)
    assert decode(payload) == TEXT  # the block's bound ends with it
