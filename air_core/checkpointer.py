"""``AsyncCheckpointer``: the one public object of the core; wires the parts and owns their lifecycle.

The training thread calls ``save`` (blocks only for the snapshot), ``latest``/``list``/``load`` (for
recovery) and ``flush``/``close``. Everything after the snapshot runs on the writer (see
``writer.py``). A failed background save is raised here, once, at the next ``save``, ``flush`` or
``close`` (or from its handle's ``result``), as ``SaveError`` carrying its step.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch

from .config import BusyPolicy, CheckpointerConfig, WriterKind, check_name
from .errors import AirError, ConfigError, CorruptCheckpointError, SaveError
from .events import Emitter, Listener, PhaseEvent, RestoreRecord
from .lease import RootLease
from .manifest import CheckpointInfo, check_relpath, default_file
from .recovery import fetch, scan, verify
from .snapshot import BufferPool, take_snapshot
from .storage import Storage
from .writer import DeleteJob, ProcessSerializer, SaveJob, Serializer, ThreadSerializer, Writer

logger = logging.getLogger(__name__)


class SaveHandle:
    """The future of one ``save``. ``done`` never blocks; ``wait_snapshot`` and ``result`` do."""

    def __init__(self, name: str, step: int, *, copy_event: Any = None, skipped: bool = False) -> None:
        self.name = name
        self.step = step
        self.skipped = skipped
        """True when ``on_busy='skip'`` dropped this save; ``result()`` then returns None."""
        self._copy_event = copy_event
        self._finished = threading.Event()
        self._info: CheckpointInfo | None = None
        self._error: SaveError | None = None
        self.reported = False
        if skipped:
            self._finished.set()

    def wait_snapshot(self) -> None:
        """Block until the device-to-host copy is done: call before the optimizer mutates the weights.

        Returns at once for CPU state, which ``save`` already copied.
        """
        if self._copy_event is not None:
            self._copy_event.synchronize()

    def done(self) -> bool:
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the commit; return its info (None if skipped).

        Raises:
            SaveError: the save failed (it is then not raised again by the checkpointer).
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"checkpoint {self.name!r} (step {self.step}) not committed within {timeout}s")
        if self._error is not None:
            self.reported = True
            raise self._error
        return self._info

    def _finish(self, info: CheckpointInfo | None, error: SaveError | None) -> None:
        self._info, self._error = info, error
        self._finished.set()


@dataclass(frozen=True)
class LocalCheckpoint:
    """Verified local copies of some files of a committed checkpoint (from ``AsyncCheckpointer.fetch``)."""

    info: CheckpointInfo
    paths: dict[str, str]
    """Path relative to the root -> local file."""
    source: Literal["local", "cache", "remote"]


class AsyncCheckpointer:
    """Asynchronous, staged, committed checkpoints of nested tensor state, to any fsspec URL.

    Example::

        with AsyncCheckpointer("s3://bucket/run1", staging_dir="/nvme/air", keep_last=3) as ckpt:
            if (info := ckpt.latest()) is not None:
                model.load_state_dict(ckpt.load(info)["model"])
            for step in range(start, steps):
                ...
                handle = ckpt.save({"model": model.state_dict(), "step": step}, step=step)
                handle.wait_snapshot()  # only needed before mutating CUDA tensors
    """

    def __init__(
        self,
        root: str,
        *,
        staging_dir: str | None = None,
        host_budget_bytes: int | None = None,
        keep_last: int = 2,
        max_in_flight: int = 1,
        on_busy: BusyPolicy = "wait",
        writer: WriterKind = "thread",
        storage_options: dict[str, Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
        launch_id: str = "",
        max_transfers: int = 8,
        retries: int = 5,
        retry_backoff_seconds: float = 0.2,
        commit_timeout_seconds: float = 600.0,
        close_timeout_seconds: float = 600.0,
        lease_seconds: float = 30.0,
        read_only: bool = False,
        listeners: Iterable[Listener] = (),
    ) -> None:
        """Validate the settings, then check the destination and staging folder are usable.

        Raises:
            ConfigError: a setting is invalid (before any I/O).
            StorageError: the root or the staging folder cannot be written.
        """
        self.config = CheckpointerConfig(
            root=root,
            staging_dir=staging_dir,
            host_budget_bytes=host_budget_bytes,
            keep_last=keep_last,
            max_in_flight=max_in_flight,
            on_busy=on_busy,
            writer=writer,
            storage_options={} if storage_options is None else storage_options,
            rank=rank,
            world_size=world_size,
            launch_id=launch_id,
            max_transfers=max_transfers,
            retries=retries,
            retry_backoff_seconds=retry_backoff_seconds,
            commit_timeout_seconds=commit_timeout_seconds,
            close_timeout_seconds=close_timeout_seconds,
            lease_seconds=lease_seconds,
            read_only=read_only,
        )
        cfg = self.config
        self._closed = True  # until fully built, so close() from a failed __init__ is a no-op
        self._storage = Storage(
            cfg.root,
            storage_options=cfg.storage_options,
            retries=cfg.retries,
            retry_backoff_seconds=cfg.retry_backoff_seconds,
        )
        key = hashlib.sha1(self._storage.url.encode()).hexdigest()[:16]
        if cfg.staging_dir is None and self._storage.is_local:
            self._cache_dir: str | None = None  # write the destination directly: never stage twice
            self._spill_dir = os.path.join(tempfile.gettempdir(), "air-spill", key)
        else:
            staging = (
                _local_dir(cfg.staging_dir)
                if cfg.staging_dir
                else os.path.join(tempfile.gettempdir(), "air-staging")
            )
            if cfg.staging_dir is None:
                logger.info(
                    "no staging_dir given: staging in %s (pass staging_dir= to use a local NVMe disk)",
                    staging,
                )
            self._cache_dir = os.path.join(staging, key)
            self._spill_dir = os.path.join(self._cache_dir, ".spill")
        _check_local_dir(self._cache_dir or self._spill_dir, "staging_dir", cfg.staging_dir)
        self._lease: RootLease | None = None
        if not cfg.read_only:
            self._storage.check_writable()
            if cfg.rank == 0:
                self._lease = RootLease(self._storage, cfg.launch_id, lease_seconds=cfg.lease_seconds)
                self._lease.acquire()
        self._emit = Emitter(listeners)
        self._pool = BufferPool(cfg.host_budget_bytes, cfg.max_in_flight, shared=cfg.writer == "process")
        serializer: Serializer = ProcessSerializer() if cfg.writer == "process" else ThreadSerializer()
        self._serializer = serializer
        fence = self._lease.check if self._lease is not None else None
        self._writer = Writer(cfg, self._storage, self._cache_dir, self._pool, serializer, self._emit, fence)
        self._handles: list[SaveHandle] = []
        self._warned_spill = False
        self._closed = False

    # -- saving ------------------------------------------------------------------------------
    def save(
        self, state: Any, *, step: int, name: str | None = None, filename: str | None = None
    ) -> SaveHandle:
        """Snapshot ``state`` and persist it in the background.

        Returns once every CPU tensor is copied into staging buffers (GPU copies are queued: call
        ``handle.wait_snapshot()`` before mutating those tensors). ``state`` may then change freely.

        Args:
            state: nested dicts/lists/tuples of tensors and picklable objects.
            step: the training step; checkpoints are ordered by it.
            name: the checkpoint's name, one path segment; default ``step-<step, 9 digits>``.
            filename: this rank's file, relative to the root; default ``<name>/rank-<rank>.pt``.

        Raises:
            SaveError: an earlier save failed; raised once, carrying that save's step.
            ConfigError: bad arguments, or ``name`` is being saved already.
        """
        name = check_name(name if name is not None else f"step-{_check_step(step):09d}")
        filename = check_relpath(filename or default_file(name, self.config.rank), where="save(filename=...)")
        return self.save_files({filename: state}, step=step, name=name)

    def save_files(self, files: Mapping[str, Any], *, step: int, name: str | None = None) -> SaveHandle:
        """Like ``save``, for a rank that writes several files into one checkpoint.

        ``files`` maps each path, relative to the root, to its state; every file is written in
        ``torch.save`` format and they commit together. Adapters use it to keep a framework's own
        folder layout (one file per model, optimizer, ...).
        """
        self._check_open("save", write=True)
        self._raise_failed()
        name = check_name(name if name is not None else f"step-{_check_step(step):09d}")
        if not files:
            raise ConfigError(f"save_files(name={name!r}): no files given.")
        for rel in files:
            check_relpath(rel, where="save_files(files=...)")
        if name in self._writer.busy:
            raise ConfigError(f"save(name={name!r}): a save of this name is still in flight; use a new name.")
        called = time.monotonic()
        self._emit(PhaseEvent("snapshot_start", name, step, self.config.rank))
        if self.config.on_busy == "skip" and not self._pool.has_free():
            logger.info(
                "rank %d: skipped checkpoint %s: the previous save is still in flight", self.config.rank, name
            )
            return SaveHandle(name, step, skipped=True)
        buffer = self._pool.acquire()
        waited = time.monotonic() - called
        try:
            snap = take_snapshot(
                dict(files),
                buffer,
                spill_dir=self._spill_dir,
                spill_name=f"{name}-r{self.config.rank}-{uuid.uuid4().hex[:6]}.spill",
            )
        except BaseException:
            self._pool.give_back(buffer)
            raise
        handle = SaveHandle(name, step, copy_event=snap.copy_event)
        blocking = time.monotonic() - called
        if snap.spilled_bytes and not self._warned_spill:
            self._warned_spill = True
            largest = max(slot.nbytes for slot in snap.slots)
            logger.warning(
                "rank %d: host_budget_bytes=%d is too small for this state (%d bytes; its largest tensor "
                "is %d bytes): %d bytes spill to staging_dir on every save, and the training thread waits "
                "for that disk write. Raise host_budget_bytes to hold the state (or None).",
                self.config.rank,
                self.config.host_budget_bytes,
                sum(slot.nbytes for slot in snap.slots),
                largest,
                snap.spilled_bytes,
            )
        self._emit(PhaseEvent("snapshot_done", name, step, self.config.rank))
        self._handles = [h for h in self._handles if not (h.done() and (h.reported or h._error is None))]
        self._handles.append(handle)
        job = SaveJob(name, step, tuple(files), snap, called, waited, blocking, handle._finish)
        self._writer.submit(job)
        return handle

    def flush(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed or failed.

        Raises:
            SaveError: a save failed (raised once).
            TimeoutError: saves still in flight after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in list(self._handles):
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not h._finished.wait(left):
                raise TimeoutError(f"checkpoint {h.name!r} (step {h.step}) still in flight after {timeout}s")
        self._raise_failed()

    def _raise_failed(self) -> None:
        failed = [h for h in self._handles if h.done() and h._error is not None and not h.reported]
        for h in failed:
            h.reported = True
        for h in failed[1:]:
            logger.error("rank %d: %s", self.config.rank, h._error)
        if failed:
            raise failed[0]._error  # type: ignore[misc]

    # -- recovery ----------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint under the root with its status, oldest step first (a fresh listing)."""
        return scan(self._storage)

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint whose files are all present at their recorded sizes."""
        committed = [i for i in self.list() if i.status == "committed"]
        return committed[-1] if committed else None

    def verify(self, info: CheckpointInfo) -> str:
        """Re-read every file of ``info`` and check its CRC-32; return the problem or ``""``."""
        return verify(self._storage, info, self._cache_dir, max_transfers=self.config.max_transfers)

    def delete(self, name: str) -> None:
        """Delete checkpoint ``name`` on the writer thread, after every save submitted before.

        The newest committed checkpoint is never deleted: its deletion waits until a newer one commits.
        Returns at once; call on rank 0 only.
        """
        self._check_open("delete", write=True)
        self._writer.submit(DeleteJob(check_name(name)))

    def fetch(
        self, info: CheckpointInfo | None = None, *, ranks: Iterable[int] | None = None
    ) -> LocalCheckpoint:
        """Local, checksum-verified copies of the files of ``ranks`` (default: this rank) in ``info``.

        ``info=None`` takes the newest committed checkpoint that verifies: a corrupt one is skipped with a
        warning that says why, and the previous one is tried. Prefers the local cache when its manifest
        matches the committed one; else downloads in parallel into the cache.

        Raises:
            FileNotFoundError: there is no committed checkpoint under the root.
            CorruptCheckpointError: ``info`` (or every committed checkpoint) fails verification.
        """
        self._check_open("fetch")
        started = time.monotonic()
        wanted = {self.config.rank} if ranks is None else set(ranks)
        problems = []
        if info is not None:
            candidates = [info]
        else:
            candidates = []
            for found in reversed(self.list()):
                if found.status == "committed":
                    candidates.append(found)
                elif found.status == "corrupt" and not candidates:  # newer than any we may load: say why
                    logger.warning(
                        "rank %d: skipping checkpoint %s: %s", self.config.rank, found.name, found.reason
                    )
                    problems.append(f"{found.name}: {found.reason}")
            if not candidates:
                why = f" ({'; '.join(problems)})" if problems else ""
                raise FileNotFoundError(f"no committed checkpoint under {self._storage.display()}{why}")
        for cand in candidates:
            if cand.manifest is None:
                raise CorruptCheckpointError(
                    f"load({cand.name!r}): {cand.status} checkpoint ({cand.reason}); only committed "
                    "checkpoints load.",
                    path=self._storage.display(cand.name),
                    reason=cand.reason or cand.status,
                )
            entries = [f for f in cand.manifest.files if f.rank in wanted]
            self._emit(PhaseEvent("restore_start", cand.name, cand.step, self.config.rank))
            try:
                paths, source = fetch(
                    self._storage,
                    self._cache_dir,
                    cand.manifest,
                    entries,
                    max_transfers=self.config.max_transfers,
                )
            except CorruptCheckpointError as exc:
                if info is not None:
                    raise
                logger.warning("rank %d: skipping checkpoint %s: %s", self.config.rank, cand.name, exc)
                problems.append(f"{cand.name}: {exc.reason}")
                continue
            seconds = time.monotonic() - started
            nbytes = sum(e.size for e in entries)
            self._emit(RestoreRecord(cand.name, cand.step, self.config.rank, seconds, source, nbytes))
            logger.info(
                "rank %d fetched %s (step %d) from %s in %.2fs",
                self.config.rank,
                cand.name,
                cand.step,
                source,
                seconds,
            )
            return LocalCheckpoint(cand, paths, source)
        raise CorruptCheckpointError(
            f"no committed checkpoint under {self._storage.display()} verifies: {'; '.join(problems)}",
            path=self._storage.display(),
            reason="all corrupt",
        )

    def load(
        self,
        info: CheckpointInfo | None = None,
        *,
        map_location: Any = "cpu",
        weights_only: bool | None = True,
        rank: int | None = None,
    ) -> Any:
        """Return this rank's state from ``info`` (default: the newest committed checkpoint that verifies).

        Fetches as ``fetch`` does (cache first, checksums verified before unpickling), then reads the
        rank's single file. ``rank`` reads another rank's file (default: this rank's);
        ``weights_only=None`` leaves the choice to ``torch.load``'s default.

        Raises:
            FileNotFoundError: there is no committed checkpoint under the root.
            CorruptCheckpointError: ``info`` (or every committed checkpoint) fails verification.
            ConfigError: the checkpoint holds no single file of this rank, or needs ``weights_only=False``.
        """
        rank = self.config.rank if rank is None else rank
        local = self.fetch(info, ranks=[rank])
        if len(local.paths) != 1:
            manifest = local.info.manifest
            assert manifest is not None
            raise ConfigError(
                f"load({local.info.name!r}) on rank {rank}: the checkpoint was written by "
                f"{manifest.world_size} rank(s) and holds {len(local.paths)} file(s) of this rank; "
                "resume with the world size it was saved with (or use fetch() for multi-file parts)."
            )
        (path,) = local.paths.values()
        return _torch_load(path, map_location, weights_only, local.info.name)

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def storage(self) -> Storage:
        """The destination root (for tools that read or write beside the checkpoints)."""
        return self._storage

    @property
    def host_bytes_allocated(self) -> int:
        """Host memory held by the staging buffers now (never above ``host_budget_bytes``)."""
        return self._pool.allocated_bytes

    @property
    def buffer_allocations(self) -> int:
        """How many times a staging buffer was allocated (stays flat while the state size does)."""
        return self._pool.allocations

    def close(self) -> None:
        """Flush (bounded by ``close_timeout_seconds``), stop the writer, free the buffers. Idempotent.

        Raises:
            SaveError: a save failed and was not reported yet.
        """
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self.config.close_timeout_seconds
        try:
            self.flush(self.config.close_timeout_seconds)
        finally:
            if not self._writer.stop(max(deadline - time.monotonic(), 0.0)):
                logger.error(
                    "rank %d: the writer did not stop within %ss",
                    self.config.rank,
                    self.config.close_timeout_seconds,
                )
            self._serializer.close()
            self._pool.close()
            if self._lease is not None:
                self._lease.release()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:  # never mask the exception already propagating
            self.close()
        except (AirError, TimeoutError) as err:
            logger.error(
                "rank %d: while handling %s, closing the checkpointer failed: %s",
                self.config.rank,
                type(exc).__name__,
                err,
            )

    def _check_open(self, what: str, *, write: bool = False) -> None:
        if self._closed:
            raise AirError(f"AsyncCheckpointer.{what}(): the checkpointer is closed.")
        if write and self.config.read_only:
            raise AirError(f"AsyncCheckpointer.{what}(): opened with read_only=True; it never writes.")


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"save(step={step!r}): step must be an integer >= 0.")
    return step


def _torch_load(path: str, map_location: Any, weights_only: bool | None, name: str) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if weights_only is False:
            raise
        lines = [line.strip() for line in str(exc).splitlines()]
        why = next((line for line in lines if "Unsupported global" in line), lines[0] if lines else "")
        raise ConfigError(
            f"load({name!r}): the checkpoint holds objects that weights_only=True refuses ({why}); "
            "unpickling them could run code. If you trust this checkpoint, pass weights_only=False."
        ) from exc


def _local_dir(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def _check_local_dir(path: str, arg: str, value: str | None) -> None:
    """Create ``path`` and prove it writable, so a bad staging folder fails before training."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe-{uuid.uuid4().hex[:8]}")
        with open(probe, "wb") as f:
            f.write(b"probe")
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"AsyncCheckpointer({arg}={value!r}): cannot write to {path} ({exc.strerror or exc}); pass a "
            "writable folder on a local disk."
        ) from exc
