"""Serialize a snapshot to local files in ``torch.save`` format, checksumming while writing.

A file's state is written by one ``torch.save``, unless it is a ``Bundle``: then its items are
written one after another (each tensor by its own ``torch.save``, bytes as they are), which is the
layout of a ``torch.distributed.checkpoint`` data file, and the extent of each item is returned. A
``raw`` bundle writes tensors as their bare bytes: ``formats.safetensors_file`` builds one.

Two strategies of the ``Serializer`` protocol, chosen once by the checkpointer (``writer=``):
``ThreadSerializer`` runs on the writer thread itself; ``ProcessSerializer`` hands the snapshot's
shared-memory parts to a long-lived process. Either writes only local files (``directio.DirectFile``:
around the page cache, CRC-32 as the bytes pass, so no file is read twice): where they go next is
``staging.py``'s job. Either calls ``tick`` often while serializing, on the writer thread, so the
writer's priority can follow its deadline (``priority.py``) in whichever thread or process serializes.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, NamedTuple, Protocol, cast

import torch

from .directio import DirectFile
from .errors import ConfigError
from .snapshot import Snapshot, materialize, materialize_parts

_POLL_SECONDS = 0.05
"""How often the writer thread checks on the writer process (and on the deadline of its priority)."""
_START_SECONDS = 300.0
"""How long the writer process may take to start: spawn imports torch and re-imports the main module."""


@dataclass
class Bundle:
    """A file of separately readable items (tensors and bytes), each at an extent of its own.

    ``torch.distributed.checkpoint``'s readers read an item by seeking to its offset: a tensor is one
    ``torch.save`` blob, bytes are raw. The extents are known only once written, so the writer returns
    them (``Written.extents``) and they travel in the rank's part record.
    """

    items: list[Any]
    """``torch.Tensor`` or ``bytes``, in file order."""
    raw: bool = False
    """Tensors are written as their bytes alone (C order, native byte order), as ``safetensors`` and
    other flat formats hold them, instead of one ``torch.save`` blob each."""


class Written(NamedTuple):
    """One serialized file."""

    size: int
    crc32: int
    extents: tuple[tuple[int, int], ...] = ()
    """A ``Bundle``'s (offset, length) per item, in order; empty for a plain file."""


def serialize_file(
    state: Any,
    path: str,
    *,
    fsync: bool,
    tick: Callable[[], None] | None = None,
    overwrite: bool = False,
) -> Written:
    """Write ``state`` (one ``torch.save``, or a ``Bundle``'s items in turn) to ``path`` (``overwrite``:
    over the recycled file there, ``DirectFile``)."""
    extents: list[tuple[int, int]] = []
    with DirectFile(path, tick=tick, overwrite=overwrite) as w:
        if isinstance(state, Bundle):
            for item in state.items:
                start = w.size
                if isinstance(item, torch.Tensor) and state.raw:
                    w.write(raw_bytes(item))
                elif isinstance(item, torch.Tensor):
                    # torch.save writes a tensor's whole storage: a view into a larger one is copied out
                    tensor = item if item.untyped_storage().nbytes() == item.nbytes else item.clone()
                    _torch_save(tensor, w)
                else:
                    w.write(item)
                extents.append((start, w.size - start))
        else:
            _torch_save(state, w)
        w.finish(fsync=fsync)
    return Written(w.size, w.crc, tuple(extents))


def _torch_save(state: Any, w: DirectFile) -> None:
    """``torch.save`` into ``w``. A write that fails in the middle of one of its records comes out of
    torch's zip writer as a RuntimeError ("unexpected pos") that hides the OSError (ENOSPC, EIO): the
    write's own error is raised instead."""
    try:
        torch.save(state, cast(IO[bytes], w))
    except RuntimeError as exc:
        if w.error is None:
            raise
        raise w.error from exc


def raw_bytes(tensor: torch.Tensor) -> Any:
    """A host tensor's elements as one flat byte buffer (a copy only for a non-contiguous view)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


class Targets(NamedTuple):
    """Where a snapshot's files go."""

    paths: dict[str, str]
    """The local path each file is written to."""
    fsync: bool
    reuse: frozenset[str] = frozenset()
    """The paths that hold a recycled file to write over (``spares.py``)."""


def serialize_files(
    state: dict[str, Any], targets: Targets, *, tick: Callable[[], None] | None = None
) -> dict[str, Written]:
    """Write each ``state[rel]`` to ``targets.paths[rel]``."""
    return {
        rel: serialize_file(state[rel], path, fsync=targets.fsync, tick=tick, overwrite=path in targets.reuse)
        for rel, path in targets.paths.items()
    }


class Serializer(Protocol):
    """Writes a snapshot (a mapping file -> state) to local files; writer thread only, one call at a time."""

    @property
    def native_id(self) -> int:
        """The OS thread that serializes (its priority is the one that matters): call on the writer thread."""
        ...

    def write(self, snap: Snapshot, targets: Targets, *, tick: Callable[[], None]) -> dict[str, Written]: ...

    def close(self) -> None: ...


class ThreadSerializer:
    """Serialize on the writer thread itself."""

    @property
    def native_id(self) -> int:
        return threading.get_native_id()

    def write(self, snap: Snapshot, targets: Targets, *, tick: Callable[[], None]) -> dict[str, Written]:
        return serialize_files(materialize(snap), targets, tick=tick)

    def close(self) -> None:
        pass


def _child_main(conn: Any) -> None:
    """The writer process: rebuild each snapshot from shared memory and serialize it.

    It ignores SIGINT and SIGTERM, as multiprocessing's resource tracker does: Ctrl-C and a scheduler's
    SIGTERM before preemption reach the whole process group, and the training process acts on them by
    flushing the save in flight, through this process. It stops when told (``close``), or when its end
    of the pipe reads end-of-file: the training process is gone (a SIGKILL sends no stop)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
    try:
        conn.send(("ready", None))
        while (job := conn.recv()) is not None:
            try:
                state = materialize_parts(
                    job["skeleton"], job["refs"], job["slots"], job["buffer"], job["spill"]
                )
                result: tuple[str, Any] = ("ok", serialize_files(state, job["targets"]))
            except BaseException as exc:  # handed to the parent, which raises SaveError
                result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            del job
            conn.send(result)
    except (EOFError, OSError):
        pass


class ProcessSerializer:
    """Serialize in a long-lived process fed through shared memory (its priority set by the writer thread).

    The process is started by spawn, which re-imports the main module before it runs anything of ours:
    a script that builds its checkpointer outside ``if __name__ == "__main__":`` fails there, and a
    writer that died starting would fail only the first save, steps later. So construction waits until
    the process is up (its imports and the main script's: about 1.3 s for a plain script here, 6 to 7 s
    for one that imports Lightning), and raises ``ConfigError`` if it died. Jobs and
    results go over one pipe (no queue: no feeder thread, no semaphore for a killed process to leak). A
    checkpointer never closed is closed at exit, before multiprocessing joins its children (forever, as
    the process waits for work); its saves are over by then, the writer thread being no daemon.
    """

    def __init__(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self._owner = os.getpid()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child,), name="air-writer-proc")
        self._proc.start()
        child.close()  # the process's end is its own: the pipe reads end-of-file when either side is gone
        atexit.register(self.close)  # runs before multiprocessing's own exit hook, registered earlier
        try:
            self._wait_started()
        except BaseException:
            self.close()
            raise

    def _wait_started(self) -> None:
        deadline = time.monotonic() + _START_SECONDS

        def late() -> None:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"writer='process': the writer process did not start within {_START_SECONDS:.0f} s "
                    "(spawn re-imports the main script: does its top level wait for something?). Use "
                    "writer='thread' (the default), or move that code under `if __name__ == \"__main__\":`."
                )

        if self._next(late) is None:
            raise ConfigError(
                f"writer='process': the writer process exited (code {self._proc.exitcode}) while starting, "
                "before any save. It starts by spawn, which re-imports the main script (its error is "
                'printed above); the usual cause is training code outside an `if __name__ == "__main__":` '
                "block. Move that code under the guard, or use writer='thread' (the default)."
            )

    def _next(self, tick: Callable[[], None]) -> tuple[str, Any] | None:
        """The process's next message (``tick`` called while waiting); None once it has exited."""
        try:
            while not self._conn.poll(_POLL_SECONDS):
                tick()
            return cast(tuple[str, Any], self._conn.recv())
        except (EOFError, OSError):
            self._proc.join(timeout=5)  # for its exit code
            return None

    @property
    def native_id(self) -> int:
        return self._proc.pid or 0  # the process serializes on its main thread, whose id is its pid

    def write(self, snap: Snapshot, targets: Targets, *, tick: Callable[[], None]) -> dict[str, Written]:
        job = {
            "skeleton": snap.skeleton,
            "refs": snap.tensors,
            "slots": snap.slots,
            "buffer": snap.buffer.tensor,
            "spill": snap.spill_path,
            "targets": targets,
        }
        try:
            self._conn.send(job)
        except OSError:
            pass  # the process is gone: the next message says so
        message = self._next(tick)
        if message is None:
            raise RuntimeError(f"the writer process died (exit code {self._proc.exitcode})")
        status, value = message
        if status != "ok":
            raise RuntimeError(f"the writer process failed: {value}")
        return {rel: Written(*w) for rel, w in value.items()}

    def close(self) -> None:
        if os.getpid() != self._owner:
            return  # the exit of a process forked from the training one: the writer process is not its own
        atexit.unregister(self.close)
        if self._proc.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


def make_serializer(kind: str) -> Serializer:
    """The strategy for ``CheckpointerConfig.writer`` (validated there): ``thread`` or ``process``."""
    return ProcessSerializer() if kind == "process" else ThreadSerializer()
