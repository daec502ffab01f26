import itertools
import random
import zlib

import pytest

from air_core.checksum import PIECE, crc32_combine, file_crc32
from air_core.tiers.transfer import CHUNK


@pytest.mark.parametrize("size", [0, 1, 4095, CHUNK - 1, CHUNK, 2 * CHUNK + 17])
def test_the_crcs_of_pieces_joined_in_order_are_the_crc_of_the_whole(size):
    data = random.Random(size).randbytes(size)
    cuts = sorted({0, size, *random.Random(size + 1).choices(range(size + 1), k=6)})
    joined = 0
    for start, end in itertools.pairwise(cuts):
        joined = crc32_combine(joined, zlib.crc32(data[start:end]), end - start)
    assert joined == zlib.crc32(data)
    assert crc32_combine(zlib.crc32(data), 0, 0) == zlib.crc32(data), "an empty piece changes nothing"


def test_pieces_joined_out_of_order_do_not_pass_for_the_whole():
    assert crc32_combine(zlib.crc32(b"b"), zlib.crc32(b"a"), 1) == zlib.crc32(b"ba") != zlib.crc32(b"ab")


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("size", [0, 1, PIECE - 1, PIECE, 3 * PIECE + 5])
def test_a_file_s_crc_checked_in_pieces_on_threads_is_zlib_s(tmp_path, size, threads):
    data = random.Random(size).randbytes(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert file_crc32(str(path), threads=threads) == zlib.crc32(data)
    damaged = bytearray(data + b"x")
    damaged[len(damaged) // 2] ^= 1
    path.write_bytes(bytes(damaged))
    assert file_crc32(str(path), threads=threads) != zlib.crc32(data + b"x")
