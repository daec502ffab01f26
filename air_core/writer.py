"""The background persist worker: serialize -> stage -> upload -> commit -> retention, one save at a time.

One named, non-daemon thread per checkpointer (started on demand, gone when idle) takes jobs from a
queue bounded by ``max_in_flight`` and runs every write *and* every delete, so operations on the
same path are ordered. Serialization (``torch.save`` format, CRC-32 computed while writing) runs
either in this thread at a lower OS priority, or in a writer process that reads the snapshot from
shared memory: a ``Serializer`` strategy chosen once. Every failure is caught at the thread boundary
and stored on the save's handle, from where the training thread raises it; nothing is reported as
success unless the manifest is written.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import queue
import threading
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, Protocol, cast

import torch

from . import commit
from .config import CheckpointerConfig
from .errors import SaveError, StorageError
from .events import Emitter, Phase, PhaseEvent, SaveRecord
from .manifest import CheckpointInfo, FileEntry, Manifest, PartRecord, library_versions, manifest_path
from .recovery import scan, write_cached_manifest
from .snapshot import BufferPool, Snapshot, materialize, materialize_parts
from .storage import Storage, fix_for

logger = logging.getLogger(__name__)
_IDLE_EXIT_SECONDS = 0.5


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


def serialize_file(state: Any, path: str, *, fsync: bool) -> tuple[int, int]:
    """Write ``state`` in ``torch.save`` format to ``path``; return (size, crc32)."""
    with open(path, "wb", buffering=0) as f:
        w = _CrcWriter(f)
        torch.save(state, cast(IO[bytes], w))
        if fsync:
            os.fsync(f.fileno())
    return w.size, w.crc


def serialize_files(
    state: dict[str, Any], paths: dict[str, str], *, fsync: bool
) -> dict[str, tuple[int, int]]:
    """Write each ``state[rel]`` to ``paths[rel]``; return rel -> (size, crc32)."""
    return {rel: serialize_file(state[rel], path, fsync=fsync) for rel, path in paths.items()}


class Serializer(Protocol):
    """Writes a snapshot (a mapping file -> state) to local files; writer thread only, one call at a time."""

    def write(self, snap: Snapshot, paths: dict[str, str], *, fsync: bool) -> dict[str, tuple[int, int]]: ...

    def close(self) -> None: ...


class ThreadSerializer:
    """Serialize on the writer thread itself (its OS priority is lowered when the thread starts)."""

    def write(self, snap: Snapshot, paths: dict[str, str], *, fsync: bool) -> dict[str, tuple[int, int]]:
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

    def write(self, snap: Snapshot, paths: dict[str, str], *, fsync: bool) -> dict[str, tuple[int, int]]:
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
        return value

    def close(self) -> None:
        if self._proc.is_alive():
            self._jobs.put(None)
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
        self._jobs.close()
        self._results.close()


@dataclass
class SaveJob:
    """One save between ``save()`` and its commit."""

    name: str
    step: int
    files: tuple[str, ...]
    """This rank's files, relative to the root; the snapshot holds a mapping of them to their state."""
    snapshot: Snapshot
    called_at: float
    wait_seconds: float
    blocking_seconds: float
    finish: Callable[[CheckpointInfo | None, SaveError | None], None]
    released: bool = False


@dataclass
class DeleteJob:
    """A request to delete one checkpoint, ordered after every save submitted before it."""

    name: str


class Writer:
    """Runs save jobs and their retention in one ordered background thread (see module docstring)."""

    def __init__(
        self,
        config: CheckpointerConfig,
        storage: Storage,
        cache_dir: str | None,
        pool: BufferPool,
        serializer: Serializer,
        emit: Emitter,
        fence: Callable[[str], None] | None = None,
    ) -> None:
        self._config = config
        self._storage = storage
        self._cache_dir = cache_dir
        self._pool = pool
        self._serializer = serializer
        self._emit = emit
        self._fence = fence or (lambda what: None)
        """Rank 0: raises if another launch took the root over (called before a commit or a delete)."""
        self._queue: queue.Queue[SaveJob | DeleteJob | None] = queue.Queue()
        self.busy: set[str] = set()
        self._deferred: set[str] = set()
        # The thread runs only while there is work: non-daemon, so the interpreter never exits with a
        # save half done, yet an idle checkpointer that was never closed does not keep a process alive.
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, job: SaveJob | DeleteJob | None) -> None:
        with self._lock:
            if isinstance(job, SaveJob):
                self.busy.add(job.name)
            self._queue.put(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"air-writer-r{self._config.rank}")
                self._thread.start()

    def stop(self, timeout_seconds: float) -> bool:
        """Finish queued jobs and let the thread exit; return whether it did within the bound."""
        self.submit(None)
        thread = self._thread
        if thread is not None:
            thread.join(timeout_seconds)
        return thread is None or not thread.is_alive()

    def _phase(self, job: SaveJob, phase: Phase) -> None:
        self._emit(PhaseEvent(phase, job.name, job.step, self._config.rank))

    def _run(self) -> None:
        try:  # Linux: a thread has its own nice value; a lower priority keeps it off the training's cores.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (OSError, AttributeError):
            logger.debug("could not lower the writer thread's priority", exc_info=True)
        while True:
            try:
                job = self._queue.get(timeout=_IDLE_EXIT_SECONDS)
            except queue.Empty:
                job = None
            if job is None:  # idle, or asked to stop: exit unless work arrived meanwhile
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
            elif isinstance(job, DeleteJob):
                self._deferred.add(job.name)
                self._run_deletes()
            else:
                self._process(job)

    def _process(self, job: SaveJob) -> None:
        cfg, storage = self._config, self._storage
        times = {"staging": 0.0, "upload": 0.0, "commit": 0.0}
        phase, size = "serialize", 0
        leftovers: list[str] = []
        staged: dict[str, str] = {}
        try:
            self._fence(f"saving checkpoint {job.name!r}")
            if storage.exists(manifest_path(job.name)):  # checked before any byte is written
                raise StorageError(
                    f"checkpoint {job.name!r} is already committed at {storage.display(job.name)}; a "
                    "committed location is never written again. Save under a new name."
                )
            # The intent names the files before they exist, so a crash leaves a partial that retention finds.
            intent = tuple(FileEntry(rel, -1, 0, cfg.rank) for rel in job.files)
            commit.write_part(storage, PartRecord(job.name, job.step, cfg.rank, cfg.launch_id, intent, False))
            self._phase(job, "serialize_start")
            t0 = time.monotonic()
            job.snapshot.wait_copied()
            if self._cache_dir is None:
                tmps = {rel: storage.local_temp(rel) for rel in job.files}
            else:
                staged = {rel: os.path.join(self._cache_dir, *rel.split("/")) for rel in job.files}
                tmps = {rel: f"{path}.air-tmp" for rel, path in staged.items()}
                for path in staged.values():
                    os.makedirs(os.path.dirname(path), exist_ok=True)
            leftovers = [*tmps.values(), *staged.values()]
            written = self._serializer.write(job.snapshot, tmps, fsync=not staged)
            _remove_spill(job.snapshot)
            for rel, tmp in tmps.items():
                if staged:
                    os.replace(tmp, staged[rel])
                else:
                    storage.place_local(tmp, rel)
            leftovers = list(staged.values())
            size = sum(s for s, _ in written.values())
            times["staging"] = time.monotonic() - t0
            self._phase(job, "staged")

            if staged:
                phase = "upload"
                self._phase(job, "upload_start")
                t0 = time.monotonic()
                for rel, path in staged.items():
                    storage.put_file(path, rel)
                times["upload"] = time.monotonic() - t0
                self._phase(job, "uploaded")

            phase = "commit"
            t0 = time.monotonic()
            entries = tuple(FileEntry(rel, *written[rel], cfg.rank) for rel in job.files)
            manifest = self._commit(job, entries)
            leftovers = []
            times["commit"] = time.monotonic() - t0
            self._phase(job, "committed")
            logger.info(
                "rank %d committed checkpoint %s (step %d, %d bytes) in %.2fs",
                cfg.rank,
                job.name,
                job.step,
                size,
                time.monotonic() - job.called_at,
            )
            info = CheckpointInfo(job.name, job.step, "committed", "", manifest)
            self._record(job, times, size)
            self._release(job)
            job.finish(info, None)
        except Exception as exc:
            for leftover in leftovers:
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
            error = SaveError(
                f"rank {cfg.rank}: saving checkpoint {job.name!r} (step {job.step}) failed during {phase}: "
                f"{type(exc).__name__}: {exc}.{self._fix(phase, exc)} The previous committed checkpoint is "
                "untouched.",
                step=job.step,
                phase=phase,
                rank=cfg.rank,
            )
            error.__cause__ = exc
            self._phase(job, "failed")
            self._record(job, times, size, error=str(error))
            self._release(job)
            job.finish(None, error)
            return
        try:
            self._retain()
        except Exception:
            logger.warning(
                "rank %d: retention after %s failed; will retry after the next commit",
                cfg.rank,
                job.name,
                exc_info=True,
            )

    def _fix(self, phase: str, exc: Exception) -> str:
        """The fix for a full local disk while serializing (storage errors name their own fix)."""
        if phase != "serialize" or not (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
            return ""
        if self._cache_dir is None:  # written straight to a local destination
            return f" {fix_for(exc)}"
        return (
            f" The staging disk is full: free space under staging_dir ({self._cache_dir}), point staging_dir "
            "at a larger disk, or lower keep_last (the local cache keeps that many checkpoints)."
        )

    def _run_deletes(self) -> None:
        """Delete what was asked for, except the newest committed checkpoint: that one waits for a newer."""
        if not self._deferred:
            return
        try:
            infos = scan(self._storage)
            committed = [i for i in infos if i.status == "committed"]
            for info in infos:
                if info.name not in self._deferred:
                    continue
                if committed and info is committed[-1]:
                    logger.info(
                        "rank %d: keeping %s until a newer checkpoint commits", self._config.rank, info.name
                    )
                    continue
                self._delete(info, infos)
                self._deferred.discard(info.name)
            self._deferred &= {i.name for i in infos}
        except Exception:
            logger.warning(
                "rank %d: deleting %s failed; will retry", self._config.rank, self._deferred, exc_info=True
            )

    def _delete(self, info: CheckpointInfo, infos: list[CheckpointInfo]) -> None:
        self._fence(f"deleting checkpoint {info.name!r}")
        self._emit(PhaseEvent("retention_start", info.name, info.step, self._config.rank))
        commit.delete_checkpoint(self._storage, info, others=infos)
        self._emit(PhaseEvent("retention_deleted", info.name, info.step, self._config.rank))

    def _release(self, job: SaveJob) -> None:
        """End the save's claim: its buffer goes back to the pool (so the next save may snapshot)."""
        if not job.released:
            job.released = True
            job.snapshot.wait_copied()
            _remove_spill(job.snapshot)
            self.busy.discard(job.name)
            self._pool.give_back(job.snapshot.buffer)

    def _commit(self, job: SaveJob, entries: tuple[FileEntry, ...]) -> Manifest:
        cfg, storage = self._config, self._storage
        part = PartRecord(job.name, job.step, cfg.rank, cfg.launch_id, entries, complete=True)
        if cfg.world_size > 1:
            commit.write_part(storage, part)
            self._phase(job, "part_written")
        if cfg.rank == 0:
            self._phase(job, "commit_start")
            parts = [part]
            if cfg.world_size > 1:
                parts = commit.wait_for_parts(
                    storage,
                    name=job.name,
                    step=job.step,
                    launch_id=cfg.launch_id,
                    world_size=cfg.world_size,
                    timeout_seconds=cfg.commit_timeout_seconds,
                )
            manifest = Manifest(
                name=job.name,
                step=job.step,
                time=time.time(),
                world_size=cfg.world_size,
                launch_id=cfg.launch_id,
                files=tuple(f for p in parts for f in p.files),
                versions=library_versions(),
            )
            self._fence(f"committing checkpoint {job.name!r}")
            commit.write_manifest(storage, manifest)
        else:
            manifest = commit.wait_for_manifest(
                storage, name=job.name, launch_id=cfg.launch_id, timeout_seconds=cfg.commit_timeout_seconds
            )
        if self._cache_dir is not None:
            write_cached_manifest(self._cache_dir, manifest)
        return manifest

    def _retain(self) -> None:
        if self._config.rank == 0:
            infos = scan(self._storage)
            for info in commit.retention_victims(infos, keep_last=self._config.keep_last, busy=self.busy):
                self._delete(info, infos)
            self._run_deletes()
        if self._cache_dir is not None:
            _trim_cache(self._cache_dir, self._config.keep_last)

    def _record(self, job: SaveJob, times: dict[str, float], size: int, error: str = "") -> None:
        self._emit(
            SaveRecord(
                name=job.name,
                step=job.step,
                rank=self._config.rank,
                wait_seconds=job.wait_seconds,
                blocking_seconds=job.blocking_seconds,
                staging_seconds=times["staging"],
                upload_seconds=times["upload"],
                commit_seconds=times["commit"],
                total_seconds=time.monotonic() - job.called_at,
                bytes=size,
                spilled_bytes=job.snapshot.spilled_bytes,
                error=error,
            )
        )


def _remove_spill(snap: Snapshot) -> None:
    if snap.spill_path:
        with contextlib.suppress(OSError):
            os.unlink(snap.spill_path)


def _trim_cache(cache_dir: str, keep_last: int) -> None:
    """Keep the local cache to the newest ``keep_last`` checkpoints it holds a manifest of.

    A node's cache holds only its own ranks' files (and rank 0's when it loaded), so a cached
    checkpoint may look incomplete there; it is trimmed by its manifest all the same.
    """
    cached = Storage(cache_dir, storage_options={}, retries=0, retry_backoff_seconds=0.0)
    infos = scan(cached)
    held = [i for i in infos if i.manifest is not None]
    for info in held[: max(len(held) - keep_last, 0)]:
        commit.delete_checkpoint(cached, info, others=infos)
