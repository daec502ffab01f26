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

import multiprocessing
import queue
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
_PARENT_POLL_SECONDS = 1.0
"""How often an idle writer process checks that the training process still lives (a SIGKILLed one sends
no stop, and the process holds both ends of its queue, so it would wait forever)."""
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


def _child_main(jobs: Any, results: Any) -> None:
    """The writer process: rebuild each snapshot from shared memory and serialize it."""
    torch.set_num_threads(1)
    results.put(("ready", None))
    parent = multiprocessing.parent_process()
    while True:
        try:
            job = jobs.get(timeout=_PARENT_POLL_SECONDS)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return  # the training process was killed: nobody will send the stop
            continue
        if job is None:
            return
        try:
            state = materialize_parts(job["skeleton"], job["refs"], job["slots"], job["buffer"], job["spill"])
            results.put(("ok", serialize_files(state, job["targets"])))
        except BaseException as exc:  # handed to the parent, which raises SaveError
            results.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        del job


class ProcessSerializer:
    """Serialize in a long-lived process fed through shared memory (its priority set by the writer thread).

    The process is started by spawn, which re-imports the main module before it runs anything of ours:
    a script that builds its checkpointer outside ``if __name__ == "__main__":`` fails there, and a
    writer that died starting would fail only the first save, steps later. So construction waits until
    the process is up (about 1.3 s of imports, here), and raises ``ConfigError`` if it died.
    """

    def __init__(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self._jobs = ctx.Queue()
        self._results = ctx.Queue()
        # daemon: a checkpointer never closed must not hang the interpreter's exit, where multiprocessing
        # joins its other children. Saves are over by then (the writer thread is not a daemon).
        self._proc = ctx.Process(
            target=_child_main, args=(self._jobs, self._results), name="air-writer-proc", daemon=True
        )
        self._proc.start()
        try:
            self._wait_started()
        except BaseException:
            self.close()
            raise

    def _wait_started(self) -> None:
        deadline = time.monotonic() + _START_SECONDS
        while time.monotonic() < deadline:
            try:
                self._results.get(timeout=_POLL_SECONDS)  # ("ready", None): the only message before a job
                return
            except queue.Empty:
                if not self._proc.is_alive():
                    raise ConfigError(
                        f"writer='process': the writer process exited (code {self._proc.exitcode}) while "
                        "starting, before any save. It starts by spawn, which re-imports the main script "
                        "(its error is printed above); the usual cause is training code outside an "
                        '`if __name__ == "__main__":` block. Move that code under the guard, or use '
                        "writer='thread' (the default)."
                    ) from None
        raise ConfigError(
            f"writer='process': the writer process did not start within {_START_SECONDS:.0f} s (spawn "
            "re-imports the main script: does its top level wait for something?). Use writer='thread' "
            '(the default), or move that code under `if __name__ == "__main__":`.'
        )

    @property
    def native_id(self) -> int:
        return self._proc.pid or 0  # the process serializes on its main thread, whose id is its pid

    def write(self, snap: Snapshot, targets: Targets, *, tick: Callable[[], None]) -> dict[str, Written]:
        self._jobs.put(
            {
                "skeleton": snap.skeleton,
                "refs": snap.tensors,
                "slots": snap.slots,
                "buffer": snap.buffer.tensor,
                "spill": snap.spill_path,
                "targets": targets,
            }
        )
        while True:
            try:
                status, value = self._results.get(timeout=_POLL_SECONDS)
                break
            except queue.Empty:
                tick()
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
