"""CRC-32 (zlib's, the manifests' checksum) of pieces computed apart and joined.

One thread computes zlib's CRC-32 at 2.4-3.9 GB/s on the 2-core machine, about the speed loopback moves
bytes, so a check on one thread bounds a restore: a received copy, a downloaded or cached file, a local
tier's part. Pieces of a file are checked on several threads (``zlib.crc32`` releases the GIL) and
their CRCs joined in order: ``crc32_combine`` is zlib's ``crc32_combine``, which Python does not
expose, written out (multiplication of polynomials modulo the CRC's, reflected as zlib's tables are).
"""

from __future__ import annotations

import functools
import os
import threading
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


THREADS = max(1, min(4, _cores()))
"""The threads a check the job waits for (a restore's) runs on: one per core it may use, at most four."""
PIECE = 8 << 20
"""Bytes a thread checks at a time."""

_POLY = 0xEDB88320
"""The CRC-32 polynomial, reflected."""


def _multiply(a: int, b: int) -> int:
    """a(x) * b(x) modulo the polynomial, both reflected (bit 31 is x^0)."""
    product, mask = 0, 1 << 31
    while mask:
        if a & mask:
            product ^= b
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
        mask >>= 1
    return product


_X_TO_2_TO_THE = [1 << 30]
"""x^(2^k) modulo the polynomial, for k = 0..63."""
for _ in range(63):
    _X_TO_2_TO_THE.append(_multiply(_X_TO_2_TO_THE[-1], _X_TO_2_TO_THE[-1]))


@functools.lru_cache(maxsize=64)
def _shift(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: appending ``nbytes`` bytes multiplies a CRC by it."""
    power, k = 1 << 31, 3
    while nbytes:
        if nbytes & 1:
            power = _multiply(_X_TO_2_TO_THE[k & 63], power)
        nbytes >>= 1
        k += 1
    return power


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``."""
    return _multiply(_shift(len2), crc1) ^ crc2


def file_crc32(path: str, *, threads: int = THREADS) -> int:
    """The CRC-32 of the file at ``path``, its ``PIECE``-sized pieces read and checked on ``threads``
    threads (each into a buffer of its own, reused; no mapping, so a file cut short under it reads short
    and fails its check instead of faulting)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        offsets = range(0, os.fstat(fd).st_size, PIECE)
        buffers = threading.local()

        def piece(offset: int) -> tuple[int, int]:
            buffer = getattr(buffers, "buffer", None)
            if buffer is None:
                buffer = buffers.buffer = bytearray(PIECE)
            view, n = memoryview(buffer), 0
            while n < PIECE and (got := os.preadv(fd, [view[n:]], offset + n)):
                n += got
            return zlib.crc32(view[:n]), n

        if threads == 1 or len(offsets) < 2:
            return _joined(map(piece, offsets))
        with ThreadPoolExecutor(min(threads, len(offsets)), "air-crc") as pool:
            return _joined(pool.map(piece, offsets))
    finally:
        os.close(fd)


def _joined(pieces: Iterable[tuple[int, int]]) -> int:
    """The CRC-32 of consecutive pieces, each given as (its CRC-32, its length)."""
    crc = 0
    for piece_crc, n in pieces:
        crc = crc32_combine(crc, piece_crc, n)
    return crc
