"""A bound on how large a compressed record batch may grow when the client decompresses it.

Kafka bounds a batch's compressed size (message.max.bytes), not what it inflates to: a 1 MB gzip bomb can
become a gigabyte in the worker's memory before any record is looked at, and snappy, lz4 and zstd inflate
just as far. kafka-python decompresses each codec through one function of `kafka.codec`, imported by name
into its record modules; those names are replaced (once per process) by decoders that stop at the bound
and raise `DecompressedTooLarge`:

- gzip, lz4 (a frame) and zstd (frames) are inflated as streams, a chunk at a time, and stop as soon as
  the output passes the bound;
- snappy (raw, or the xerial framing of the Java client: blocks of raw snappy) states each block's
  uncompressed length in its preamble, and the decoder allocates exactly that: the stated lengths are
  added up and checked before anything is decompressed.

The bound is the one `decompression_bound` sets for the current thread (the group consumer and the control
reader set theirs while they decode a batch), else `DEFAULT_MAX_DECOMPRESSED` (other readers).
"""

from __future__ import annotations

import contextlib
import io
import struct
import zlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import kafka.codec as kafka_codec
import kafka.record.default_records as default_records
import kafka.record.legacy_records as legacy_records

DEFAULT_MAX_DECOMPRESSED = 64 * 2**20
_CHUNK = 1 << 20
_XERIAL_MAGIC = b"\x82SNAPPY\x00"
_XERIAL_HEADER = 16

_limit: ContextVar[int] = ContextVar("inferq_max_decompressed", default=DEFAULT_MAX_DECOMPRESSED)

Decoder = Callable[[bytes], bytes]


class DecompressedTooLarge(ValueError):
    pass


def _too_large(codec: str, limit: int) -> DecompressedTooLarge:
    return DecompressedTooLarge(f"a {codec} batch inflates past {limit} bytes")


def _bounded_gzip_decode(limit: int) -> Decoder:
    def gzip_decode(payload) -> bytes:
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip framing
        out = bytearray()
        data = bytes(payload)
        while data:
            out += inflater.decompress(data, _CHUNK)
            if len(out) > limit:
                raise _too_large("gzip", limit)
            data = inflater.unconsumed_tail
            if inflater.eof:
                break
        out += inflater.flush()
        if len(out) > limit:
            raise _too_large("gzip", limit)
        return bytes(out)

    return gzip_decode


def _raw_snappy_length(block: bytes) -> int:
    """The uncompressed length a raw snappy block states in its preamble (a little-endian varint)."""
    length = shift = 0
    for i, byte in enumerate(block[:5]):
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return length
        shift += 7
        if i == 4:
            break
    raise ValueError("a snappy block without a valid length preamble")


def _xerial_blocks(data: bytes) -> Iterator[bytes]:
    cursor = _XERIAL_HEADER
    while cursor < len(data):
        if cursor + 4 > len(data):
            raise ValueError("a truncated xerial snappy block header")
        (size,) = struct.unpack_from("!i", data, cursor)
        cursor += 4
        if size < 0 or cursor + size > len(data):
            raise ValueError(f"a xerial snappy block of {size} bytes at {cursor} overruns the payload")
        yield data[cursor : cursor + size]
        cursor += size


def _bounded_snappy_decode(limit: int) -> Decoder:
    def snappy_decode(payload) -> bytes:
        data = bytes(payload)
        # kafka-python's own test for the xerial framing (the Java client's), so both read the same bytes
        xerial = len(data) > _XERIAL_HEADER and data[:8] == _XERIAL_MAGIC
        blocks = list(_xerial_blocks(data)) if xerial else [data]
        if sum(_raw_snappy_length(b) for b in blocks) > limit:
            raise _too_large("snappy", limit)
        snappy = kafka_codec.snappy
        return b"".join(snappy.decompress(b) for b in blocks)

    return snappy_decode


def _bounded_lz4_decode(limit: int) -> Decoder:
    def lz4_decode(payload) -> bytes:
        frame = kafka_codec.lz4  # lz4.frame, or None when only kafka-python's other lz4 modules are there
        if frame is None:
            raise ValueError("lz4 batches are decoded with the lz4 package, which is not installed")
        decompressor = frame.LZ4FrameDecompressor()
        out = bytearray(decompressor.decompress(bytes(payload), max_length=_CHUNK))
        while not decompressor.eof and not decompressor.needs_input:
            if len(out) > limit:
                raise _too_large("lz4", limit)
            out += decompressor.decompress(b"", max_length=_CHUNK)
        if len(out) > limit:
            raise _too_large("lz4", limit)
        if not decompressor.eof:
            raise ValueError("a truncated lz4 frame")
        return bytes(out)

    return lz4_decode


def _bounded_zstd_decode(limit: int) -> Decoder:
    def zstd_decode(payload) -> bytes:
        zstd = kafka_codec.zstd
        out = bytearray()
        source = io.BytesIO(bytes(payload))
        with zstd.ZstdDecompressor().stream_reader(source, read_across_frames=True) as reader:
            while chunk := reader.read(_CHUNK):
                out += chunk
                if len(out) > limit:
                    raise _too_large("zstd", limit)
        return bytes(out)

    return zstd_decode


_FACTORIES = {
    "gzip": _bounded_gzip_decode,
    "snappy": _bounded_snappy_decode,
    "lz4": _bounded_lz4_decode,
    "zstd": _bounded_zstd_decode,
}


def bounded_decoder(codec: str, limit: int) -> Decoder:
    """A decoder of `codec` (gzip, snappy, lz4, zstd) that raises DecompressedTooLarge past `limit` bytes."""
    return _FACTORIES[codec](limit)


def _current(codec: str) -> Decoder:
    factory = _FACTORIES[codec]

    def decode(payload) -> bytes:
        return factory(_limit.get())(payload)

    decode.__name__ = f"{codec}_decode"
    return decode


_installed = False


def install_bounds() -> None:
    """Route kafka-python's decompression (every codec, both record formats) through the bounded decoders.

    Idempotent; the bound itself is read at each batch (`decompression_bound`)."""
    global _installed
    if _installed:
        return
    decoders = {f"{codec}_decode": _current(codec) for codec in _FACTORIES}
    for name, decode in decoders.items():
        setattr(default_records, name, decode)
        if hasattr(legacy_records, name):  # the old formats know no zstd
            setattr(legacy_records, name, decode)
    # lz4 of the oldest format repairs a header and then calls kafka.codec's lz4_decode by name
    kafka_codec.lz4_decode = decoders["lz4_decode"]
    _installed = True


@contextlib.contextmanager
def decompression_bound(limit: int) -> Iterator[None]:
    """Batches decoded in this block (in this thread) inflate to at most `limit` bytes each."""
    token = _limit.set(limit)
    try:
        yield
    finally:
        _limit.reset(token)
