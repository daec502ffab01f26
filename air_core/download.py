"""Byte ranges of a remote file streamed into place: the reader behind ``Storage.get_files``.

A cold restore of a multi-GiB file over one HTTP stream is held to one connection's throughput, and
s3fs's own ranged ``get_file`` holds whole parts in memory (50 MiB x 10 by default). Here a file is
split into parts of at most ``PART_BYTES``; each part is read in pieces written with ``os.pwrite`` at
their offset in a preallocated temp file, so memory stays at a piece per running part, whatever the
part size. s3fs exposes the response body as a stream (read ``STREAM_BYTES`` at a time, one request
per part); any other fsspec filesystem is read with ranged ``cat_file`` calls of ``READ_BYTES``.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Any

from .internals import S3_CALL

logger = logging.getLogger(__name__)

PART_BYTES = 64 << 20
"""At most this much per ranged request. Large, because a request costs a round trip (and some
servers, moto among them, read the whole object for every range); a GiB still spreads over 16."""
STREAM_BYTES = 1 << 20
READ_BYTES = 8 << 20
PROGRESS_SECONDS = 10.0
"""A download running longer logs its progress this often, and its summary at INFO (else DEBUG)."""


def parts(size: int) -> list[tuple[int, int]]:
    """``(start, end)`` byte ranges (end exclusive) covering ``size`` bytes, ``PART_BYTES`` at most each."""
    return [(start, min(start + PART_BYTES, size)) for start in range(0, size, PART_BYTES)]


def read_range(fs: Any, path: str, start: int, end: int, fd: int) -> None:
    """Write bytes ``[start, end)`` of ``path`` at the same offsets of ``fd``.

    Raises:
        OSError: ``EIO`` when the file ended early (it changed since its size was read).
    """
    if type(fs).__module__.startswith("s3fs"):
        from fsspec.asyn import sync

        got = sync(fs.loop, _stream_s3, fs, path, start, end, fd)
    else:
        got = _read_ranged(fs, path, start, end, fd)
    if got != end - start:
        raise OSError(errno.EIO, f"{path}: expected {end - start} bytes from offset {start}, got {got}")


async def _stream_s3(fs: Any, path: str, start: int, end: int, fd: int) -> int:
    from s3fs.core import version_id_kw

    bucket, key, version = fs.split_path(path)
    response = await S3_CALL.get(fs)(
        "get_object",
        Bucket=bucket,
        Key=key,
        Range=f"bytes={start}-{end - 1}",
        **version_id_kw(version),
        **fs.req_kw,
    )
    body, offset = response["Body"], start
    try:
        while chunk := await body.read(STREAM_BYTES):
            os.pwrite(fd, chunk, offset)
            offset += len(chunk)
    finally:
        body.close()
    return offset - start


def _read_ranged(fs: Any, path: str, start: int, end: int, fd: int) -> int:
    offset = start
    while offset < end:
        data = fs.cat_file(path, start=offset, end=min(offset + READ_BYTES, end))
        if not data:
            break
        os.pwrite(fd, data, offset)
        offset += len(data)
    return offset - start


class Progress:
    """Bytes downloaded so far, logged every ``PROGRESS_SECONDS`` (a cold restore of many GiB is long)."""

    def __init__(self, total: int, where: str) -> None:
        self.total, self.where = total, where
        self.done = 0
        self.started = self._logged = time.perf_counter()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        """``n`` more bytes are in (any thread)."""
        with self._lock:
            self.done += n
            now = time.perf_counter()
            if now - self._logged < PROGRESS_SECONDS:
                return
            self._logged = now
        logger.info(
            "downloading from %s: %.0f of %.0f MiB (%.0f MiB/s)",
            self.where,
            self.done / 2**20,
            self.total / 2**20,
            self.done / 2**20 / (now - self.started),
        )

    def finish(self, files: int, ranges: int) -> None:
        seconds = time.perf_counter() - self.started
        log = logger.info if seconds >= PROGRESS_SECONDS else logger.debug
        log(
            "downloaded %d file(s), %.1f MiB in %d range(s) from %s in %.2fs (%.0f MiB/s)",
            files,
            self.total / 2**20,
            ranges,
            self.where,
            seconds,
            self.total / 2**20 / max(seconds, 1e-9),
        )
