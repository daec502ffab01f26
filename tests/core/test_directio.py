"""Checkpoint files written around the page cache hold exactly the bytes given, with their CRC."""

from __future__ import annotations

import errno
import os
import random
import shutil
import threading
import zlib

import pytest

from air_core import directio
from air_core.directio import CHUNK_BYTES, DirectFile, copy_file, in_memory
from air_core.priority import own_nice

SIZES = [0, 1, 4095, 4096, CHUNK_BYTES - 1, CHUNK_BYTES, 2 * CHUNK_BYTES + 17]
FOLDERS = ["tmp", "shm"]  # a disk (O_DIRECT) and tmpfs (written straight into its pages)


@pytest.fixture(autouse=True)
def _no_folder_left_in_shm():
    yield
    shutil.rmtree(f"/dev/shm/air-test-{os.getpid()}", ignore_errors=True)


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


@pytest.mark.parametrize("kind", FOLDERS)
def test_many_small_writes_around_large_ones_land_in_order(kind: str, tmp_path):
    """Small writes through the page cache are gathered into fewer system calls: still every byte in
    order, whatever the mix of sizes, and a tick per chunk."""
    rng = random.Random(0)
    sizes = (
        [rng.randrange(1, 3000) for _ in range(200)]
        + [CHUNK_BYTES + 5]
        + [rng.randrange(1, 70_000) for _ in range(40)]
    )
    data = os.urandom(sum(sizes))
    path = os.path.join(_folder(kind, tmp_path), "pieces")
    ticks: list[int] = []
    try:
        with DirectFile(path, tick=lambda: ticks.append(1)) as f:
            start = 0
            for n in sizes:
                f.write(memoryview(data)[start : start + n])
                start += n
            f.finish(fsync=False)
        with open(path, "rb") as f2:
            assert f2.read() == data
        assert f.crc == zlib.crc32(data) and f.size == len(data)
        assert len(ticks) == -(-len(data) // CHUNK_BYTES)
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


def _open_flags(path: str) -> int:
    """The flags this process opened ``path`` with (its descriptor's ``/proc/self/fdinfo``)."""
    fd = next(fd for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == path)
    with open(f"/proc/self/fdinfo/{fd}") as f:
        return next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))


@pytest.mark.parametrize("kind", FOLDERS)
def test_files_in_memory_are_written_straight_through_and_those_on_disk_around_the_page_cache(kind, tmp_path):
    folder = _folder(kind, tmp_path)
    if kind == "tmp" and in_memory(folder):
        pytest.skip(f"{folder} is in memory here: no disk folder to try O_DIRECT on")
    assert in_memory(folder) == (kind == "shm"), f"{folder}: /proc/self/mountinfo names its filesystem"
    path = os.path.realpath(os.path.join(folder, "flags"))
    try:
        with DirectFile(path) as f:
            direct = bool(_open_flags(path) & os.O_DIRECT)
            f.write(b"x" * 5000)
            f.finish(fsync=False)
        assert direct == (kind == "tmp"), "O_DIRECT on a disk; tmpfs pages are the file: no aligned copy"
        with open(path, "rb") as back:
            assert back.read() == b"x" * 5000
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_a_large_write_s_failure_in_the_helper_is_raised_by_write_and_kept(tmp_path):
    """A large write through the page cache is copied in by a helper thread: a failing copy (every write
    to /dev/full gets ENOSPC) comes out of ``write`` as the OSError itself, and ``error`` keeps it."""
    folder = _folder("shm", tmp_path)
    path = os.path.join(folder, "full")
    os.symlink("/dev/full", path)
    try:
        with DirectFile(path) as f:
            with pytest.raises(OSError) as raised:
                f.write(os.urandom(CHUNK_BYTES + 1))
        assert raised.value.errno == errno.ENOSPC
        assert f.error is raised.value, "the first failed write is kept for a caller that hides it"
    finally:
        os.unlink(path)


def test_the_helper_copies_a_large_write_at_the_nice_value_of_the_thread_writing(tmp_path, monkeypatch):
    """The writer yields to training until its deadline (``priority.py``): the helper that copies its
    large writes must run at the writer's nice value of the moment, not at the one it started with."""
    folder = _folder("shm", tmp_path)
    seen: list[tuple[int, int | None]] = []
    real = directio._write_all

    def recording(fd: int, view: memoryview) -> None:
        seen.append((threading.get_native_id(), own_nice()))
        real(fd, view)

    monkeypatch.setattr(directio, "_write_all", recording)
    monkeypatch.setattr(directio._Helper, "_pool", None)  # helpers of this test's own, shut down after it
    data = os.urandom(2 * CHUNK_BYTES)
    path = os.path.join(folder, "nice")
    nices: list[int | None] = []

    def write_at(nice: int) -> None:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        nices.append(own_nice())
        with DirectFile(path) as f:
            f.write(data)
            f.finish(fsync=False)
        assert f.crc == zlib.crc32(data)

    try:
        for nice in (5, 12):  # a thread may raise its own nice value without privileges
            seen.clear()
            writer = threading.Thread(target=write_at, args=(nice,))
            writer.start()
            writer.join()
            assert seen and all(tid != writer.native_id for tid, _ in seen), "a helper thread copied"
            assert {n for _, n in seen} == {nices[-1]} == {nice}
        with open(path, "rb") as back:
            assert back.read() == data
    finally:
        if directio._Helper._pool is not None:
            directio._Helper._pool[1].shutdown()
        if os.path.exists(path):
            os.unlink(path)
