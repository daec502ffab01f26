"""Checkpoint files written around the page cache hold exactly the bytes given, with their CRC."""

from __future__ import annotations

import os
import zlib

import pytest

from air_core.directio import CHUNK_BYTES, DirectFile, copy_file

SIZES = [0, 1, 4095, 4096, CHUNK_BYTES - 1, CHUNK_BYTES, 2 * CHUNK_BYTES + 17]
FOLDERS = ["tmp", "shm"]  # a disk (O_DIRECT) and tmpfs (which refuses it: the page-cache path)


def _folder(kind: str, tmp_path) -> str:
    if kind == "tmp":
        return str(tmp_path)
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    folder = os.path.join("/dev/shm", f"air-test-{os.getpid()}")
    os.makedirs(folder, exist_ok=True)
    return folder


@pytest.mark.parametrize("kind", FOLDERS)
@pytest.mark.parametrize("size", SIZES)
def test_file_holds_exactly_the_written_bytes_and_their_crc(kind: str, size: int, tmp_path):
    data = os.urandom(size)
    path = os.path.join(_folder(kind, tmp_path), f"f-{size}")
    ticks: list[int] = []
    try:
        with DirectFile(path, tick=lambda: ticks.append(1)) as f:
            # uneven pieces, as torch.save writes small records between large storages
            for start, end in [(0, size // 3), (size // 3, size // 3 + 7), (size // 3 + 7, size)]:
                assert f.write(memoryview(data)[start:end]) == max(0, min(end, size) - start)
            f.finish(fsync=True)
        with open(path, "rb") as f2:
            back = f2.read()
        assert back == data, f"the file must hold the {size} bytes written, no padding"
        assert f.crc == zlib.crc32(data) and f.size == size, "CRC and size are those of the bytes written"
        assert len(ticks) == -(-size // CHUNK_BYTES), "tick is called once per chunk written"
    finally:
        if kind == "shm" and os.path.exists(path):
            os.unlink(path)


@pytest.mark.parametrize("size", [0, 5000, CHUNK_BYTES + 4096 + 3])
def test_copy_holds_exactly_the_source_bytes(size: int, tmp_path):
    data = os.urandom(size)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(data)
    copy_file(str(src), str(dst))
    assert dst.read_bytes() == data, f"the copy must hold the source's {size} bytes exactly"
