"""A bound on how large a compressed record batch may grow when the client decompresses it.

Kafka bounds a batch's compressed size (message.max.bytes), not what it inflates to: a 1 MB gzip bomb can
become a gigabyte in the worker's memory before any record is looked at. kafka-python decompresses
gzip through one function; it is replaced (once per process) by a streaming decoder that stops at the
bound and raises, which the group consumer turns into an undecodable record it steps over.
"""

from __future__ import annotations

import zlib

import kafka.record.default_records as default_records
import kafka.record.legacy_records as legacy_records

_CHUNK = 1 << 20


class DecompressedTooLarge(ValueError):
    pass


def _bounded_gzip_decode(limit: int):
    def gzip_decode(payload) -> bytes:
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip framing
        out = bytearray()
        data = bytes(payload)
        while data:
            out += inflater.decompress(data, _CHUNK)
            if len(out) > limit:
                raise DecompressedTooLarge(f"a gzip batch inflates past {limit} bytes")
            data = inflater.unconsumed_tail
            if inflater.eof:
                break
        out += inflater.flush()
        if len(out) > limit:
            raise DecompressedTooLarge(f"a gzip batch inflates past {limit} bytes")
        return bytes(out)

    return gzip_decode


def bound_decompression(limit: int) -> None:
    decode = _bounded_gzip_decode(limit)
    default_records.gzip_decode = decode
    legacy_records.gzip_decode = decode
