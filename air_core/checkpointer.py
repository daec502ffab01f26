"""``AsyncCheckpointer``: the one public object of the core; wires the parts and owns their lifecycle.

The training thread calls ``save`` (blocks only for the snapshot), ``latest``/``list``/``fetch``/
``load`` (recovery) and ``flush``/``close``; everything after the snapshot runs on the writer thread
(``writer.py``). It holds no pipeline logic: strategies (destination, serializer) are chosen once in
``__init__``. A failed background save is raised here, once, at the next ``save``, ``flush`` or
``close`` (or from its handle's ``result``), as ``SaveError`` carrying its step.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Literal

import torch

from . import layout, open_roots, spares
from .catalog import Catalog, read_catalog
from .config import BusyPolicy, CheckpointerConfig, WriterKind, check_filename, check_name, check_step
from .errors import AirError, ConfigError
from .events import Emitter, Listener, PhaseEvent, RestoreRecord
from .handle import SaveHandle
from .lease import RootLease
from .manifest import CheckpointInfo
from .procfs import Process
from .recovery import LocalCheckpoint, load_file, one_restore, restore, verify_with
from .serializer import make_serializer
from .snapshot import BufferPool, clear_dead_spills, spill_name, take_snapshot
from .staging import choose_destination
from .storage import Storage, remove_emptied
from .writer import DeleteJob, Finalize, SaveJob, Writer

__all__ = ["AsyncCheckpointer", "LocalCheckpoint", "SaveHandle"]  # the last two live in handle/recovery
logger = logging.getLogger(__name__)


class AsyncCheckpointer:
    """Asynchronous, staged, committed checkpoints of nested tensor state, to any fsspec URL.

    Example::

        with AsyncCheckpointer("s3://bucket/run1", staging_dir="/nvme/air", keep_last=3) as ckpt:
            if (info := ckpt.latest()) is not None:
                model.load_state_dict(ckpt.load(info)["model"])
            for step in range(start, steps):
                ...
                handle = ckpt.save({"model": model.state_dict(), "step": step}, step=step)
                handle.wait_snapshot()  # before mutating CUDA (or gated) tensors
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
        peers: tuple[Process, ...] = (),
        max_transfers: int = 8,
        retries: int = 5,
        retry_backoff_seconds: float = 0.2,
        commit_timeout_seconds: float = 600.0,
        close_timeout_seconds: float = 600.0,
        lease_seconds: float = 30.0,
        recycle_files: bool = False,
        read_only: bool = False,
        label: str = "",
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
            peers=peers,
            max_transfers=max_transfers,
            retries=retries,
            retry_backoff_seconds=retry_backoff_seconds,
            commit_timeout_seconds=commit_timeout_seconds,
            close_timeout_seconds=close_timeout_seconds,
            lease_seconds=lease_seconds,
            recycle_files=recycle_files,
            read_only=read_only,
            label=label,
        )
        cfg = self.config
        if not cfg.root:
            raise ConfigError(
                "AsyncCheckpointer(root=''): root must be a non-empty path or URL, e.g. 's3://bucket/run1'."
            )
        self._closed = True  # until fully built, so close() from a failed __init__ is a no-op
        # First: a writer process that cannot start (spawn and an unguarded script) is a ConfigError,
        # raised before any I/O. Reads start no process.
        self._serializer = make_serializer("thread" if cfg.read_only else cfg.writer)
        try:
            self._open_root(cfg)
        except BaseException:
            self._serializer.close()
            raise
        self._emit = Emitter(listeners)
        self._pool = BufferPool(cfg.host_budget_bytes, cfg.max_in_flight, shared=cfg.writer == "process")
        fence = self._lease.check if self._lease is not None else None
        self._writer = Writer(cfg, self._storage, self._dest, self._pool, self._serializer, self._emit, fence)
        self._handles: list[SaveHandle] = []
        self._restores: list[RestoreRecord] | None = None  # inside ``restoring``
        self._warned_spill = False
        self.bring: Callable[[set[str]], dict[str, str]] | None = None
        """None, or how DCP data files that a checkpoint's ``.metadata`` names but the root does not hold
        are brought: a resume from the local tier leaves those of the parts its node lacked with the
        ranks that hold them (``tiers.Resume.bring``). Called through ``bring_files``."""
        self._closed = False
        if not cfg.read_only:
            open_roots.register(self._root_key, self)

    def _open_root(self, cfg: CheckpointerConfig) -> None:
        """Reach the root and the staging folder; a writer checks both are writable and leases the root."""
        self._storage = Storage(
            cfg.root,
            storage_options=cfg.storage_options,
            retries=cfg.retries,
            retry_backoff_seconds=cfg.retry_backoff_seconds,
        )
        self._dest = choose_destination(cfg, self._storage)
        self._cache_dir = self._dest.cache_dir  # None: the root is written in place
        if not cfg.read_only:
            clear_dead_spills(self._dest.spill_dir, cfg.rank)
        self._lease: RootLease | None = None
        self._root_key = (str(self._storage.fs.protocol), self._storage.base)
        # A probe of its own, which fails in seconds where the root's endpoint is wrong or down.
        probe = Storage.probe(cfg.root, storage_options=cfg.storage_options, beside=self._storage)
        if cfg.read_only:
            probe.check_reachable()
        else:
            probe.check_writable()
        if not cfg.read_only and cfg.rank == 0:
            open_roots.take_over(self._root_key, self._storage.url, self)
            self._lease = RootLease(self._storage, cfg.launch_id, lease_seconds=cfg.lease_seconds)
            self._lease.acquire()

    @classmethod
    def from_config(
        cls, config: CheckpointerConfig, *, listeners: Iterable[Listener] = ()
    ) -> AsyncCheckpointer:
        """An ``AsyncCheckpointer`` of ``config`` (a settings object built once and passed on; its
        ``owner`` named the adapter in the errors of that build)."""
        settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "owner"}
        return cls(**settings, listeners=listeners)

    # -- saving ------------------------------------------------------------------------------
    def save(
        self,
        state: Any,
        *,
        step: int,
        name: str | None = None,
        filename: str | None = None,
        in_order: Iterable[torch.Tensor] = (),
        gated: Iterable[torch.Tensor] = (),
    ) -> SaveHandle:
        """Snapshot ``state`` and persist it in the background.

        Returns once every CPU tensor but the ``gated`` ones is copied into staging buffers; GPU copies
        are queued. Call ``handle.wait_snapshot()`` before mutating GPU or ``gated`` tensors (the
        optimizer step); everything else in ``state`` may change freely.

        Args:
            state: nested dicts/lists/tuples of tensors and picklable objects.
            step: the training step; checkpoints are ordered by it.
            name: the checkpoint's name, one path segment; default ``step-<step, 9 digits>``.
            filename: this rank's file, relative to the root; default ``<name>/rank-<rank>.pt``.
            in_order: GPU tensors of ``state`` that the next forward updates in place, before the
                optimizer step's ``wait_snapshot`` (the model's buffers: BatchNorm statistics). Their
                copies are queued on the current stream, ahead of that forward; the rest overlap it.
            gated: CPU tensors of ``state`` that nothing mutates before the caller's
                ``wait_snapshot`` (the trained parameters and the optimizer's state, when the caller
                gates its optimizer steps): copied on a thread, overlapping the next forward and
                backward, as GPU copies are.

        Raises:
            SaveError: an earlier save failed; raised once, carrying that save's step.
            ConfigError: bad arguments, or ``name`` is being saved already.
        """
        name = check_name(name if name is not None else layout.default_name(check_step(step)))
        filename = check_filename(
            filename or layout.default_file(name, self.config.rank), call="save(filename=...)"
        )
        return self.save_files({filename: state}, step=step, name=name, in_order=in_order, gated=gated)

    def save_files(
        self,
        files: Mapping[str, Any],
        *,
        step: int,
        name: str | None = None,
        finalize: Finalize | None = None,
        in_order: Iterable[torch.Tensor] = (),
        gated: Iterable[torch.Tensor] = (),
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Like ``save`` (``in_order``, ``gated`` as there), for a rank that writes several files into one
        checkpoint.

        ``files`` maps each path, relative to the root, to its state; every file is written in
        ``torch.save`` format (a ``Bundle``: its items one after another) and they commit together.
        Adapters use it to keep a framework's own folder layout (one file per model, optimizer, ...).
        ``finalize`` (read on rank 0): files made from every rank's part record before the commit
        (``air_core.dcp`` writes its ``.metadata`` so). ``metadata`` (read on rank 0; JSON values): kept
        in the manifest (``info.manifest.metadata``), so a reader can choose among commits without
        reading their files.
        """
        self._check_open("save", write=True)
        self._raise_failed()
        name = check_name(name if name is not None else layout.default_name(check_step(step)))
        if not files:
            raise ConfigError(f"save_files(name={name!r}): no files given.")
        for rel in (*files, *(finalize.files if finalize is not None else ())):
            check_filename(rel, call="save_files(files=...)")
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
                spill_dir=self._dest.spill_dir,
                spill_name=spill_name(name, self.config.rank),
                in_order=in_order,
                gated=gated,
                for_process=self.config.writer == "process",
            )
        except BaseException:
            self._pool.give_back(buffer)
            raise
        handle = SaveHandle(name, step, copies=snap.copies)
        blocking = time.monotonic() - called
        if snap.spilled_bytes and not self._warned_spill:
            self._warned_spill = True
            logger.warning("rank %d: %s", self.config.rank, snap.spill_warning(self.config.host_budget_bytes))
        self._emit(PhaseEvent("snapshot_done", name, step, self.config.rank))
        self._handles = [h for h in self._handles if not h.done() or h.unreported_error() is not None]
        self._handles.append(handle)
        job = SaveJob(
            name,
            step,
            tuple(files),
            snap,
            called,
            waited,
            blocking,
            handle._finish,
            finalize,
            dict(metadata or {}),
        )
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
            if not h.wait(left):
                raise TimeoutError(f"checkpoint {h.name!r} (step {h.step}) still in flight after {timeout}s")
        self._raise_failed()

    def _raise_failed(self) -> None:
        """Raise the first failed save not yet reported (log any others); each is reported once."""
        failed = [err for h in self._handles if (err := h.unreported_error()) is not None]
        for h in self._handles:
            h.reported = h.reported or h.unreported_error() is not None
        for err in failed[1:]:
            logger.error("rank %d: %s", self.config.rank, err)
        if failed:
            raise failed[0]

    # -- recovery ----------------------------------------------------------------------------
    def list(self, *, settle: bool = True) -> list[CheckpointInfo]:
        """Every checkpoint under the root with its status, oldest step first (a fresh listing).

        Like every read, it first waits for the saves this process has in flight to the root, so a save
        that returned is listed committed (``settle=False``: list now; those show as partial).
        """
        return builtins.list(self.catalog(settle=settle).infos)

    def catalog(self, *, settle: bool = True) -> Catalog:
        """``list()`` with the files each unfinished checkpoint's part records name (what it was writing)."""
        if settle:
            open_roots.settle(self._root_key, self._storage.url, "listing")
        return read_catalog(self._storage)

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint whose files are all present at their recorded sizes."""
        committed = [i for i in self.list() if i.status == "committed"]
        return committed[-1] if committed else None

    def verify(self, info: CheckpointInfo) -> str:
        """Re-read every file of ``info`` and check its CRC-32; return the problem or ``""``."""
        open_roots.settle(self._root_key, self._storage.url, "a verification")
        return verify_with(self._dest, info, max_transfers=self.config.max_transfers)

    def keep(self, names: Iterable[str]) -> None:
        """Retention keeps these checkpoints (a framework's best), counting them among ``keep_last`` as
        the newest; applies from the next commit on. Replaces the names given before."""
        self._writer.kept = frozenset(check_name(n) for n in names)

    def hurry(self) -> None:
        """Training now waits for the save being written: it stops yielding the CPU to training (its
        background priority, ``priority.py``) for the rest of the save. Any thread."""
        self._writer.hurry()

    def delete(self, name: str, *, even_newest: bool = False) -> threading.Event:
        """Delete checkpoint ``name`` on the writer thread, after every save submitted before.

        The newest committed checkpoint is kept until a newer one commits (a job must always have one to
        resume from), unless ``even_newest``: an explicit removal that no newer save will follow.
        Returns at once, with an event set once the writer thread has run the delete; call on rank 0 only.
        """
        self._check_open("delete", write=True)
        job = DeleteJob(check_name(name), even_newest=even_newest)
        self._writer.submit(job)
        return job.ran

    def fetch(
        self,
        info: CheckpointInfo | None = None,
        *,
        ranks: Iterable[int] | None = None,
        paths: Iterable[str] | None = None,
    ) -> LocalCheckpoint:
        """Local, checksum-verified copies of the files of ``ranks`` (default: this rank) in ``info``,
        or of the files at ``paths`` (relative to the root) when given.

        ``info=None`` takes the newest committed checkpoint that verifies: a corrupt one is skipped with a
        warning that says why, and the previous one is tried. Prefers the local cache when its manifest
        matches the committed one; else downloads in parallel into the cache.

        Raises:
            FileNotFoundError: there is no committed checkpoint under the root.
            CorruptCheckpointError: ``info`` (or every committed checkpoint) fails verification.
        """
        local, record = self._restore(info, ranks=ranks, paths=paths)
        self._restored(record)
        return local

    def bring_files(self, info: CheckpointInfo, paths: set[str]) -> dict[str, str]:
        """Local, checked copies of those of ``paths`` (of ``info``, a DCP load's data files) that the root
        does not hold but ``bring`` brings (path -> local file; empty without ``bring``), counted in the
        restore like a fetch. Every rank calls it together, even with nothing to read: it may send."""
        if self.bring is None:
            return {}
        started = time.monotonic()
        brought = self.bring(paths)
        if brought:
            took = time.monotonic() - started
            size = sum(os.path.getsize(local) for local in brought.values())
            self._restored(
                RestoreRecord(info.name, info.step, self.config.rank, took, "local", size, fetch_seconds=took)
            )
        return brought

    @contextlib.contextmanager
    def restoring(
        self,
        *,
        tier: Literal["remote", "local", "replica"] = "remote",
        before: float = 0.0,
        done: Iterable[RestoreRecord] = (),
    ) -> Iterator[None]:
        """Report the fetches and loads made inside as one restore: one ``RestoreRecord``, timed over the
        whole block, emitted when it ends without an exception.

        A framework's resume is one restore but several reads: a sharded load fetches each DCP folder's
        metadata and then its files, and an adapter also reads every rank's small state file. Reported
        one by one, each looked like a resume of its own (in the metrics and the goodput log), and
        the time between them (DCP reading slices, copying into the model) was not counted at all.
        Nested blocks report with the outermost. Calling thread only. ``tier``: where the checkpoint came
        from (``RestoreRecord.tier``); ``before``: seconds spent getting it there, added to the record;
        ``done``: reads of it made earlier by another checkpointer of the root (a resume found and
        fetched before training started), which count in it.
        """
        if self._restores is not None:
            yield
            return
        self._restores = list(done)
        started = time.monotonic()
        try:
            yield
            records = self._restores
        finally:
            self._restores = None
        if records:
            record = one_restore(records, time.monotonic() - started + before)
            self._emit(dataclasses.replace(record, tier=tier))

    def _restored(self, record: RestoreRecord) -> None:
        if self._restores is not None:
            self._restores.append(record)
        else:
            self._emit(record)

    def _restore(
        self, info: CheckpointInfo | None, *, ranks: Iterable[int] | None, paths: Iterable[str] | None
    ) -> tuple[LocalCheckpoint, RestoreRecord]:
        self._check_open("fetch")
        open_roots.settle(self._root_key, self._storage.url, "a restore")
        return restore(
            self._storage,
            self._dest,
            info,
            ranks={self.config.rank} if ranks is None else set(ranks),
            files=None if paths is None else set(paths),
            max_transfers=self.config.max_transfers,
            rank=self.config.rank,
            emit=self._emit,
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
        rank's single file, memory-mapped: its tensors are backed by the verified local file (privately:
        writing to them never changes it), so ``load_state_dict`` from them makes no second full copy.
        ``rank`` reads another rank's file (default: this rank's); ``weights_only=None`` leaves the
        choice to ``torch.load``'s default.

        Raises:
            FileNotFoundError: there is no committed checkpoint under the root.
            CorruptCheckpointError: ``info`` (or every committed checkpoint) fails verification.
            ConfigError: the checkpoint holds no single file of this rank, or needs ``weights_only=False``.
        """
        rank = self.config.rank if rank is None else rank
        local, record = self._restore(info, ranks=[rank], paths=None)
        loading = time.monotonic()
        state = load_file(local, rank=rank, map_location=map_location, weights_only=weights_only)
        took = time.monotonic() - loading
        self._restored(dataclasses.replace(record, seconds=record.seconds + took, load_seconds=took))
        return state

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def storage(self) -> Storage:
        """The destination root (for tools that read or write beside the checkpoints)."""
        return self._storage

    @property
    def local_dir(self) -> str:
        """This node's folder of this root: the staging cache, or the spill folder of a root written in
        place."""
        return self._dest.cache_dir or self._dest.spill_dir

    @property
    def host_bytes_allocated(self) -> int:
        """Host memory held by the staging buffers now (never above ``host_budget_bytes``)."""
        return self._pool.allocated_bytes

    @property
    def buffer_allocations(self) -> int:
        """How many times a staging buffer was allocated (stays flat while the state size does)."""
        return self._pool.allocations

    def in_flight(self) -> builtins.list[str]:
        """Names of the saves not committed or failed yet."""
        return [h.name for h in self._handles if not h.done()]

    def wait_in_flight(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds) for the saves in flight; unlike ``flush``, raise nothing."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(
            h.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            for h in list(self._handles)
        )

    @property
    def closed(self) -> bool:
        """Closed by ``close``, or by a newer writer of the same root in this process."""
        return self._closed

    def close(self) -> None:
        """Flush (bounded by ``close_timeout_seconds``), stop the writer, free the buffers. Idempotent.

        Raises:
            SaveError: a save failed and was not reported yet.
        """
        if self._closed:
            return
        self._closed = True
        open_roots.unregister(self._root_key, self)
        deadline = time.monotonic() + self.config.close_timeout_seconds
        try:
            self.flush(self.config.close_timeout_seconds)
        finally:
            if self._writer.stop(max(deadline - time.monotonic(), 0.0)):
                if self.config.recycle_files:  # the spares go with the writer that kept them
                    spares.clear(self._storage)
            else:
                logger.error(
                    "rank %d: the writer did not stop within %ss",
                    self.config.rank,
                    self.config.close_timeout_seconds,
                )
            self._serializer.close()
            self._pool.close()
            if self._lease is not None:
                self._lease.release()
            if self._cache_dir is None:  # a root written in place: its node folder (made to prove the spill
                spill = self._dest.spill_dir  # folder writable) goes once empty; thousands were left
                remove_emptied(spill, below=os.path.dirname(spill))

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
