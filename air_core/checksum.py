"""CRC-32 (zlib's, the manifests' checksum) of pieces computed apart and joined.

One thread computes zlib's CRC-32 at about the speed loopback moves bytes (3.5-4 GB/s each on the 2-core
machine), so a receiver that checks a copy on one thread runs at best at the wire's speed, and slower
once it also writes. Pieces of a file can be checked on several threads (``zlib.crc32`` releases the GIL)
and their CRCs joined in order: ``crc32_combine`` is zlib's ``crc32_combine``, which Python does not
expose, written out (multiplication of polynomials modulo the CRC's, reflected as zlib's tables are).
"""

from __future__ import annotations

import functools

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
