"""Write local checkpoint files around the page cache: O_DIRECT from an aligned buffer, CRC as bytes pass.

A checkpoint is written once and read rarely, so caching its pages only costs. On a busy host the
page-cache path (allocate, copy and later write back every page) took over 80% of the writer's CPU and
most of its time until durable (``benchmarks/checkpoint_stall.py --load train``: 768 MiB, 1.7 s of CPU
buffered against 0.3 s direct). So a file is written in ``CHUNK_BYTES`` pieces copied into a
page-aligned buffer the device reads from. Where the filesystem refuses ``O_DIRECT`` (some FUSE
mounts, tmpfs before Linux 6.6) the file goes through the page cache instead, logged once: the same
bytes and the same fsync, only more CPU. A filesystem in memory (tmpfs, ramfs: ``/dev/shm``, the local
tier's usual disk) is written straight through without asking: its pages are the file, and since Linux
6.6 tmpfs takes ``O_DIRECT`` as a buffered write, which the copy into the aligned buffer only adds to.
A large write through the page cache overlaps its two passes over the bytes: a helper thread copies
each chunk into the file while the writer computes its CRC-32 (both release the GIL), so a file lands in
tmpfs in about the time of the copy alone (``_Helper``). Placing files (rename, folder fsync) is
``storage.py``'s job, not this module's.
"""

from __future__ import annotations

import errno
import functools
import io
import logging
import mmap
import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .priority import own_nice

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
"""Bytes per write system call (larger chunks measured no faster, smaller ones cost more calls)."""
_GATHER_BYTES = 64 << 10
"""Writes through the page cache smaller than this are gathered into one system call."""
_OVERLAP_BYTES = CHUNK_BYTES
"""Writes through the page cache this large are copied in by a helper thread while their CRC-32 is
computed (``_Helper``). Below it the hand-over costs more than it saves on a busy host: with 1 MiB
writes and every core training, the local tier's saves of a 9.5 MB state waited longer for their commit
(``benchmarks/goodput_failures.py``'s job with the CPU step, timed per call)."""
COPY_CHUNK_BYTES = 1 << 20
"""Bytes per read and write of ``copy_file``: it holds two such buffers (one per parallel transfer)."""
_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_warned: set[int] = set()
"""Devices already logged as refusing O_DIRECT."""


class DirectFile(io.RawIOBase):
    """A new local file, written around the page cache where the filesystem allows; checksums its bytes.

    ``write`` accepts any buffer and returns its length; ``tick`` is called after each chunk reaches
    the file. ``finish(fsync=...)`` writes the tail (and fsyncs); ``close`` releases the file. Writer
    thread only. ``overwrite``: ``path`` holds a recycled file (``spares.py``), written over in
    place, its pages reused rather than freed and allocated again, and cut to the new size at ``finish``.
    """

    def __init__(
        self,
        path: str,
        *,
        tick: Callable[[], None] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        overwrite: bool = False,
    ) -> None:
        super().__init__()
        flags = os.O_WRONLY | os.O_CREAT | (0 if overwrite else os.O_TRUNC) | getattr(os, "O_CLOEXEC", 0)
        self._direct = bool(_O_DIRECT) and not in_memory(os.path.dirname(os.path.abspath(path)))
        try:
            self._fd = os.open(path, flags | (_O_DIRECT if self._direct else 0), 0o644)
        except OSError as exc:
            if not self._direct or exc.errno != errno.EINVAL:
                raise
            _buffered_once(path, exc)
            self._direct = False
            self._fd = os.open(path, flags, 0o644)
        self._path = path
        self._overwrite = overwrite
        self._chunk = chunk_bytes
        self._view = _aligned_buffer(chunk_bytes) if self._direct else memoryview(b"")
        self._fill = 0
        self._gathered = bytearray()
        self._tick = tick or (lambda: None)
        self.crc = 0
        self.size = 0
        self.error: OSError | None = None
        """The first write that failed (a caller such as ``torch.save`` may report it as something else)."""

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        try:
            if self._direct:
                self.crc = zlib.crc32(view, self.crc)  # one call per buffer: zlib releases the GIL for it
                self._into_buffer(view)
            elif len(view) < _OVERLAP_BYTES:
                self.crc = zlib.crc32(view, self.crc)
                self._through(view)
            else:
                self._write_gathered()
                self._write_through(view, checksum=True)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.size += len(view)
        return len(view)

    def _into_buffer(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            n = min(self._chunk - self._fill, len(view) - done)
            self._view[self._fill : self._fill + n] = view[done : done + n]
            self._fill += n
            done += n
            if self._fill == self._chunk:
                self._write_buffer(self._chunk)

    def _through(self, view: memoryview) -> None:
        """Through the page cache: a large buffer is written from where it is (no copy of ours); small
        ones (``torch.save``'s headers and records, hundreds per file) are gathered into one system
        call."""
        if len(view) < _GATHER_BYTES:
            self._gathered += view
            if len(self._gathered) >= _GATHER_BYTES:
                self._write_gathered()
            return
        self._write_gathered()
        self._write_through(view)

    def _write_gathered(self) -> None:
        if self._gathered:
            gathered, self._gathered = self._gathered, bytearray()
            self._write_through(memoryview(gathered))

    def _write_through(self, view: memoryview, *, checksum: bool = False) -> None:
        """Write ``view`` a chunk at a time; with ``checksum``, each chunk's CRC-32 is computed here while
        the helper thread writes it (the chunks still reach the file one after another, in order)."""
        done = 0
        while done < len(view):
            piece = view[done : done + self._chunk - self._fill]
            if checksum:
                written = _Helper.write(self._fd, piece)
                self.crc = zlib.crc32(piece, self.crc)
                written.result()
            else:
                _write_all(self._fd, piece)
            done += len(piece)
            self._fill += len(piece)  # the chunk's bytes written so far: a tick per chunk, as the direct path
            if self._fill == self._chunk:
                self._fill = 0
                self._tick()

    def finish(self, *, fsync: bool) -> None:
        """Write what is buffered, cut the file to its size, and fsync it if asked."""
        self._write_gathered()
        if self._fill and not self._direct:
            self._fill = 0
            self._tick()
        elif self._fill:
            # O_DIRECT writes whole blocks: pad the tail, then truncate the padding away.
            self._write_buffer(-(-self._fill // _ALIGN) * _ALIGN)
            os.ftruncate(self._fd, self.size)
        if self._overwrite:  # a recycled file may have been longer
            os.ftruncate(self._fd, self.size)
        if fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()

    def _write_buffer(self, length: int) -> None:
        done = 0
        while done < length:
            try:
                done += os.write(self._fd, self._view[done:length])
            except OSError as exc:
                if not self._direct or exc.errno != errno.EINVAL:
                    raise
                self._go_buffered(exc)  # the filesystem took the flag but refuses direct writes
                length = self._fill
        self._fill = 0
        self._tick()

    def _go_buffered(self, exc: OSError) -> None:
        _buffered_once(self._path, exc)
        _drop_direct(self._fd)
        self._direct = False


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


class _Helper:
    """The threads that copy large writes into the page cache while the writer checksums them.

    Each write runs at the nice value of the thread that asked for it, read at that moment: the writer
    yields to training until its deadline and no longer after it (``priority.py``), and its copies must
    do the same. A process forked after the pool started gets a pool of its own.
    """

    _pool: tuple[int, ThreadPoolExecutor] | None = None
    _lock = threading.Lock()

    @classmethod
    def write(cls, fd: int, view: memoryview) -> Future[None]:
        with cls._lock:
            if cls._pool is None or cls._pool[0] != os.getpid():
                cls._pool = (os.getpid(), ThreadPoolExecutor(4, thread_name_prefix="air-write"))
            pool = cls._pool[1]
        return pool.submit(cls._write_at, own_nice(), fd, view)

    @staticmethod
    def _write_at(nice: int | None, fd: int, view: memoryview) -> None:
        if nice is not None and own_nice() != nice:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, nice)
            except OSError:
                logger.debug("could not set a write helper's nice value to %d", nice, exc_info=True)
        _write_all(fd, view)


_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def in_memory(folder: str) -> bool:
    """Whether ``folder`` is on a filesystem held in memory (tmpfs, ramfs), by its device's entry in
    ``/proc/self/mountinfo`` (False where that cannot be read)."""
    return _fs_type(os.stat(folder).st_dev) in _MEMORY_FILESYSTEMS


@functools.lru_cache(maxsize=64)
def _fs_type(device: int) -> str:
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:  # "36 35 98:0 /root /mnt rw,... master:1 - ext4 /dev/sda1 rw"
                fields, _, tail = line.partition(" - ")
                if fields.split()[2:3] == [wanted]:
                    return tail.split()[0]
    except OSError:
        pass
    return ""


_local = threading.local()


def _aligned_buffer(size: int) -> memoryview:
    """This thread's page-aligned buffer of ``size`` bytes (as O_DIRECT needs), kept for its next files:
    a new one per file costs its page faults and zeroing again."""
    buffers: dict[int, memoryview] = _local.__dict__.setdefault("buffers", {})
    if size not in buffers:
        buffers[size] = memoryview(mmap.mmap(-1, size))
    return buffers[size]


def open_read(path: str) -> int:
    """A descriptor reading ``path`` around the page cache where the filesystem allows (``read_at``)."""
    try:
        return os.open(path, os.O_RDONLY | _O_DIRECT)
    except OSError as exc:
        if not _O_DIRECT or exc.errno != errno.EINVAL:
            raise
        return os.open(path, os.O_RDONLY)


def read_at(fd: int, buffer: mmap.mmap, offset: int) -> int:
    """Read into ``buffer`` (page-aligned, as ``mmap`` gives) from ``offset`` (a multiple of 4 KiB) of
    ``fd`` (from ``open_read``); the bytes read, fewer at the end of the file. Reading a checkpoint through
    the page cache cost 0.5-1.1 s of CPU per 576 MiB on the 2-core machine, around it 0.16 s."""
    try:
        return os.preadv(fd, [buffer], offset)
    except OSError as exc:
        if exc.errno != errno.EINVAL or not _O_DIRECT:
            raise
        _drop_direct(fd)
        return os.preadv(fd, [buffer], offset)


def copy_file(src: str, dst: str) -> None:
    """Copy local file ``src`` to a new file ``dst``, reading and writing around the page cache.

    Staged files reach a local root on another device this way (not fsynced here: the caller syncs and
    places ``dst``).
    """
    fd = open_read(src)
    buffer = mmap.mmap(-1, COPY_CHUNK_BYTES)
    try:
        with DirectFile(dst, chunk_bytes=COPY_CHUNK_BYTES) as out:
            while n := _read_into(fd, buffer):
                out.write(memoryview(buffer)[:n])
            out.finish(fsync=False)
    finally:
        os.close(fd)
        buffer.close()


def _read_into(fd: int, buffer: mmap.mmap) -> int:
    try:
        return os.readv(fd, [buffer])
    except OSError as exc:
        if exc.errno != errno.EINVAL or not _O_DIRECT:
            raise
        _drop_direct(fd)
        return os.readv(fd, [buffer])


def _drop_direct(fd: int) -> None:
    """Clear ``O_DIRECT`` on an open file whose filesystem took the flag but refuses direct I/O."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def _buffered_once(path: str, exc: OSError) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    device = os.stat(folder).st_dev
    if device not in _warned:
        _warned.add(device)
        logger.info(
            "%s does not take O_DIRECT writes (%s): checkpoint files there go through the page cache, "
            "which costs the writer more CPU on a busy host",
            folder,
            exc.strerror,
        )
