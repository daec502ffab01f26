"""Serialize a snapshot to local files in ``torch.save`` format, checksumming while writing.

A file's state is written by one ``torch.save``, unless it is a ``Bundle``: then its items are
written one after another (each tensor by its own ``torch.save``, bytes as they are), which is the
layout of a ``torch.distributed.checkpoint`` data file, and the extent of each item is returned.

Two strategies of the ``Serializer`` protocol, chosen once by the checkpointer (``writer=``):
``ThreadSerializer`` runs on the writer thread itself; ``ProcessSerializer`` hands the snapshot's
shared-memory parts to a long-lived, lower-priority process. Either writes only local files: where
they go next is ``staging.py``'s job. CRC-32 is computed as the bytes pass (zlib releases the GIL on
big chunks), so no file is read twice.
"""

from __future__ import annotations

import io
import os
import queue
import traceback
import zlib
from dataclasses import dataclass
from typing import IO, Any, NamedTuple, Protocol, cast

import torch

from .snapshot import Snapshot, materialize, materialize_parts


class _CrcWriter(io.RawIOBase):
    """A write-only file that checksums what passes through (zlib releases the GIL on big chunks)."""

    def __init__(self, f: io.RawIOBase) -> None:
        self._f = f
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        written = 0
        while written < len(view):
            written += self._f.write(view[written:])
        return written


@dataclass
class Bundle:
    """A file of separately readable items (tensors and bytes), each at an extent of its own.

    ``torch.distributed.checkpoint``'s readers read an item by seeking to its offset: a tensor is one
    ``torch.save`` blob, bytes are raw. The extents are known only once written, so the writer returns
    them (``Written.extents``) and they travel in the rank's part record.
    """

    items: list[Any]
    """``torch.Tensor`` or ``bytes``, in file order."""


class Written(NamedTuple):
    """One serialized file."""

    size: int
    crc32: int
    extents: tuple[tuple[int, int], ...] = ()
    """A ``Bundle``'s (offset, length) per item, in order; empty for a plain file."""


def serialize_file(state: Any, path: str, *, fsync: bool) -> Written:
    """Write ``state`` (one ``torch.save``, or a ``Bundle``'s items in turn) to ``path``."""
    extents: list[tuple[int, int]] = []
    with open(path, "wb", buffering=0) as f:
        w = _CrcWriter(f)
        if isinstance(state, Bundle):
            for item in state.items:
                start = w.size
                if isinstance(item, torch.Tensor):
                    # torch.save writes a tensor's whole storage: a view into a larger one is copied out
                    tensor = item if item.untyped_storage().nbytes() == item.nbytes else item.clone()
                    torch.save(tensor, cast(IO[bytes], w))
                else:
                    w.write(item)
                extents.append((start, w.size - start))
        else:
            torch.save(state, cast(IO[bytes], w))
        if fsync:
            os.fsync(f.fileno())
    return Written(w.size, w.crc, tuple(extents))


def serialize_files(state: dict[str, Any], paths: dict[str, str], *, fsync: bool) -> dict[str, Written]:
    """Write each ``state[rel]`` to ``paths[rel]``."""
    return {rel: serialize_file(state[rel], path, fsync=fsync) for rel, path in paths.items()}


class Serializer(Protocol):
    """Writes a snapshot (a mapping file -> state) to local files; writer thread only, one call at a time."""

    def write(self, snap: Snapshot, paths: dict[str, str], *, fsync: bool) -> dict[str, Written]: ...

    def close(self) -> None: ...


class ThreadSerializer:
    """Serialize on the writer thread itself (its OS priority is lowered when the thread starts)."""

    def write(self, snap: Snapshot, paths: dict[str, str], *, fsync: bool) -> dict[str, Written]:
        return serialize_files(materialize(snap), paths, fsync=fsync)

    def close(self) -> None:
        pass


def _child_main(jobs: Any, results: Any) -> None:
    """The writer process: rebuild each snapshot from shared memory and serialize it."""
    try:
        os.nice(10)
    except OSError:
        pass
    torch.set_num_threads(1)
    while (job := jobs.get()) is not None:
        try:
            state = materialize_parts(job["skeleton"], job["refs"], job["slots"], job["buffer"], job["spill"])
            results.put(("ok", serialize_files(state, job["paths"], fsync=job["fsync"])))
        except BaseException as exc:  # handed to the parent, which raises SaveError
            results.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        del job


class ProcessSerializer:
    """Serialize in a long-lived, lower-priority process fed through shared memory."""

    def __init__(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self._jobs = ctx.Queue()
        self._results = ctx.Queue()
        self._proc = ctx.Process(target=_child_main, args=(self._jobs, self._results), name="air-writer-proc")
        self._proc.start()

    def write(self, snap: Snapshot, paths: dict[str, str], *, fsync: bool) -> dict[str, Written]:
        self._jobs.put(
            {
                "skeleton": snap.skeleton,
                "refs": snap.tensors,
                "slots": snap.slots,
                "buffer": snap.buffer.tensor,
                "spill": snap.spill_path,
                "paths": paths,
                "fsync": fsync,
            }
        )
        while True:
            try:
                status, value = self._results.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._proc.is_alive():
                    raise RuntimeError(f"the writer process died (exit code {self._proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"the writer process failed: {value}")
        return {rel: Written(*w) for rel, w in value.items()}

    def close(self) -> None:
        if self._proc.is_alive():
            self._jobs.put(None)
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
        self._jobs.close()
        self._results.close()


def make_serializer(kind: str) -> Serializer:
    """The strategy for ``CheckpointerConfig.writer`` (validated there): ``thread`` or ``process``."""
    return ProcessSerializer() if kind == "process" else ThreadSerializer()
