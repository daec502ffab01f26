"""Upload a staged file to an object store part by part, each part read just before it is sent, and
the parts of a file the serializer is still writing sent as soon as they are written.

s3fs's own ``put_file`` reads a file below 100 MiB whole into memory, and a larger one ten 50 MiB
parts at a time: a save's size in memory again, on the host the snapshot already fills. Here an S3
file above ``PART_BYTES`` goes up as a multipart upload whose parts are read from the staged file (on a
worker thread, so the event loop keeps sending, and around the page cache) only when one of
``PARTS_IN_FLIGHT`` slots is free: ``PART_BYTES x PARTS_IN_FLIGHT`` bytes of bodies in memory per file,
whatever its size, plus ``READ_BUFFERS`` read buffers. Parts of 16 MiB sent
four at a time are what the AWS CLI does (8 MiB, ten at a time); moto, the S3 server the tests and
benchmarks run, keeps parts up to 16 MiB in memory and writes larger ones to a temp file.

``Growing`` lets the upload follow the serializer: a part is sent once the file has grown past it, so
a save is durable about one part after its last byte is written, not one upload after
(``benchmarks/remote_save.py``). A failed upload is aborted, so no parts linger (S3 bills them); a
killed process leaves an incomplete upload, which a bucket lifecycle rule
(``AbortIncompleteMultipartUpload``) removes. Other filesystems use their own ``put_file`` once the
file is complete. Retries of the whole file are ``storage.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import mmap
import os
import queue
import threading
from typing import Any

from .directio import open_read, read_at
from .internals import S3_CALL

PART_BYTES = 16 << 20
PARTS_IN_FLIGHT = 4
READ_BUFFERS = 2
"""Page-aligned buffers a file's parts are read into around the page cache (``directio.read_at``), each
copied out at once into the part's body."""
_SLACK = 4096
"""A file being written with O_DIRECT is padded to a 4 KiB block for a moment at its end: bytes that
close to the end are not read until the file is finished."""
_POLL_SECONDS = 0.01


class Abandoned(Exception):
    """The file will never be finished (its save failed): the upload stops."""


class Growing:
    """A staged file the serializer is still writing at ``temp`` (then renamed to ``final``).

    The serializer's side calls ``finish(size)`` once the file is complete (before it is renamed), or
    ``abandon()``; the upload's side asks ``poll`` how far it may read, or waits for ``finished``.
    """

    def __init__(self, temp: str, final: str) -> None:
        self.temp, self.final = temp, final
        self._size: int | None = None
        self._abandoned = False
        self._cond = threading.Condition()

    def finish(self, size: int) -> None:
        with self._cond:
            self._size = size
            self._cond.notify_all()

    def abandon(self) -> None:
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()

    def poll(self, end: int) -> tuple[int | None, bool]:
        """(the final size if the file is finished, whether bytes ``[0, end)`` are written)."""
        with self._cond:
            if self._abandoned:
                raise Abandoned
            if self._size is not None:
                return self._size, True
        try:
            return None, os.stat(self.temp).st_size >= end + _SLACK
        except FileNotFoundError:
            return None, False

    def finished(self) -> int:
        """Block until the file is finished; its size."""
        with self._cond:
            self._cond.wait_for(lambda: self._abandoned or self._size is not None)
            if self._abandoned:
                raise Abandoned
            assert self._size is not None
            return self._size

    def open(self) -> int:
        """A descriptor of the file (``directio.open_read``): at ``temp`` while written, at ``final`` once
        renamed."""
        try:
            return open_read(self.temp)
        except FileNotFoundError:
            return open_read(self.final)


async def _grown(growing: Growing, end: int) -> int | None:
    """Once bytes ``[0, end)`` of the file are written: None; once it is finished: its size."""
    while True:
        size, ready = growing.poll(end)
        if size is not None or ready:
            return size
        await asyncio.sleep(_POLL_SECONDS)


def follows(fs: Any) -> bool:
    """Whether uploads to ``fs`` can follow a file being written (S3: parts as they are written)."""
    return type(fs).__module__.startswith("s3fs")


def answered_puts(fs: Any) -> None:
    """S3: PUTs without botocore's ``Expect: 100-continue``. aiohttp waits for the 100 with no timeout
    (its read timeout starts once the body is sent), so an endpoint that accepts the connection and never
    answers (a stuck proxy) held a save, or the root's probe, forever; with the body sent at once the
    read timeout bounds the wait and the retries apply. The cost: a PUT the server refuses (bad
    credentials) sends its body first. ``fs`` is the Storage's own instance (never shared)."""
    if follows(fs):
        from botocore.handlers import add_expect_header

        fs.connect()  # botocore's client (no request); s3fs never makes another one by itself
        fs.s3.meta.events.unregister("before-call.s3", add_expect_header)


def put_file(fs: Any, local_path: str, path: str, growing: Growing | None = None) -> None:
    """Upload ``local_path`` (or the file ``growing`` follows) to ``path`` of ``fs``, all or nothing."""
    if follows(fs):
        from fsspec.asyn import sync

        sync(fs.loop, _put_s3, fs, local_path, path, growing)
        return
    if growing is not None:
        growing.finished()  # an upload that cannot follow the file waits for all of it
        local_path = growing.final
    fs.put_file(local_path, path)


async def _put_s3(fs: Any, local_path: str, path: str, growing: Growing | None) -> None:
    call = S3_CALL.get(fs)
    bucket, key, _ = fs.split_path(path)
    loop = asyncio.get_running_loop()

    async def wait(end: int) -> int | None:
        return await _grown(growing, end) if growing is not None else None

    if growing is not None:
        await _grown(growing, 0)  # the file exists (or is finished, and perhaps renamed)
        fd = growing.open()
    else:
        fd = open_read(local_path)
    buffers: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
    for _ in range(READ_BUFFERS):
        buffers.put(mmap.mmap(-1, PART_BYTES))

    def read_part(start: int, end: int) -> bytes:
        buffer = buffers.get()
        try:
            n = read_at(fd, buffer, start)
            if n < end - start:
                raise OSError(errno.EIO, f"{local_path} ended at {start + n} bytes, before {end}")
            # The body: one copy out of the reused buffer, as immutable bytes. s3fs retries a failed
            # call with the same ``Body``; a stream body would be resent from where the failed attempt
            # stopped reading it (the S3 proxy's checksum check refuses that in the fault tests).
            return buffer[: end - start]
        finally:
            buffers.put(buffer)

    try:
        size = await wait(PART_BYTES) if growing is not None else os.fstat(fd).st_size

        async def read(start: int, end: int) -> bytes:
            return await loop.run_in_executor(None, read_part, start, end)

        if size is not None and size <= PART_BYTES:
            await call("put_object", Bucket=bucket, Key=key, Body=await read(0, size))
            return
        upload = (await call("create_multipart_upload", Bucket=bucket, Key=key))["UploadId"]
        slots = asyncio.Semaphore(PARTS_IN_FLIGHT)

        async def part(number: int, start: int, end: int) -> dict[str, Any]:
            async with slots:
                body = await read(start, end)
                out = await call(
                    "upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=body
                )
            return {"PartNumber": number, "ETag": out["ETag"]}

        tasks: list[asyncio.Future[dict[str, Any]]] = []

        def send(start: int, end: int) -> None:
            tasks.append(asyncio.ensure_future(part(len(tasks) + 1, start, end)))

        try:
            start = 0
            while size is None:  # each whole part goes as soon as the file holds it
                size = await wait(start + PART_BYTES)
                if size is None:
                    send(start, start + PART_BYTES)
                    start += PART_BYTES
            for begin in range(start, size, PART_BYTES):
                send(begin, min(begin + PART_BYTES, size))
            parts = await asyncio.gather(*tasks)
            await call(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=upload,
                MultipartUpload={"Parts": list(parts)},
            )
        except BaseException:
            for task in tasks:  # no part may still read the file or send once the upload is aborted
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
            raise
    finally:
        os.close(fd)
        while not buffers.empty():
            with contextlib.suppress(BufferError):  # a cancelled part's read may still hold it
                buffers.get().close()
        fs.invalidate_cache(path)
