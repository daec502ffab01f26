"""The background persist worker: one save at a time, phase by phase, then retention.

One named, non-daemon thread per checkpointer (started on demand, gone after 0.5 s idle) runs every
save *and* delete in submission order, so operations on one path never race. ``_save`` reads top to
bottom: begin -> serialize -> upload -> record part -> commit -> retain. Where files go is the
``Destination`` chosen once (``staging.py``), how bytes are made the ``Serializer``. Every failure is
caught at the thread boundary and stored on the save's handle: only a written manifest is success.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import commit, procfs, spares
from .catalog import Catalog, read_catalog
from .config import CheckpointerConfig
from .errors import SaveError
from .events import DeleteRecord, Emitter, Phase, PhaseEvent, SaveRecord
from .manifest import CheckpointInfo, FailureRecord, FileEntry, Manifest, PartRecord, library_versions
from .priority import WriterPriority, own_nice
from .serializer import Serializer, Targets, Written
from .snapshot import BufferPool, Snapshot
from .staging import Destination, Following
from .storage import Put, Storage

logger = logging.getLogger(__name__)
_IDLE_EXIT_SECONDS = 0.5


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
    finalize: Finalize | None = None
    """Rank 0: small files made from every rank's part record, written before the manifest."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Rank 0: recorded in the manifest (``Manifest.metadata``), for a caller choosing among commits."""
    released: bool = False


@dataclass(frozen=True)
class Finalize:
    """More files of a checkpoint that only rank 0 can make, once every rank's part is at the destination.

    ``make`` runs on rank 0's writer thread with every rank's complete part record and returns the
    bytes of each of ``files`` (named up front so the intent record lists them: a crash leaves no
    file that retention cannot find).
    """

    files: tuple[str, ...]
    make: Callable[[list[PartRecord]], Mapping[str, bytes]]


@dataclass
class DeleteJob:
    """A request to delete one checkpoint, ordered after every save submitted before it."""

    name: str
    even_newest: bool = False
    """Delete it even if it is the newest committed one (an explicit removal, not retention)."""
    ran: threading.Event = field(default_factory=threading.Event)
    """Set once the writer thread has run it (deleted, deferred, or failed and left for a retry)."""


@dataclass
class _Progress:
    """How far one save got: the phase a failure is reported in, timings, and what to clean up."""

    phase: str = "serialize"
    seconds: dict[str, float] = field(default_factory=lambda: {"staging": 0.0, "upload": 0.0, "commit": 0.0})
    size: int = 0
    leftovers: list[str] = field(default_factory=list)
    """Local files a failure must remove (temp files, then staged copies)."""
    attempt: int = 1
    """Which save of this checkpoint name this is (a name saved again after it failed: 2, ...)."""
    moved: dict[str, int] = field(
        default_factory=lambda: {"staged": 0, "uploaded": 0, "linked": 0, "in_place": 0}
    )
    """Bytes staged, uploaded, linked and written in place (``SaveRecord``); rank 0's become every rank's
    at the commit."""
    staging_disk: int = 0
    following: Following | None = None
    """The uploads that started while serializing (``Destination.follow``), if the root allows."""


class Writer:
    """Runs save jobs and deletes in one ordered background thread (see the module docstring).

    Jobs wait in an unbounded queue on purpose: a save is bounded *before* it is queued (it cannot
    snapshot without one of the pool's ``max_in_flight`` buffers, which ``save`` waits for), and a
    delete is only a name. Blocking ``submit`` instead could stall the training thread on a delete.
    """

    def __init__(
        self,
        config: CheckpointerConfig,
        storage: Storage,
        destination: Destination,
        pool: BufferPool,
        serializer: Serializer,
        emit: Emitter,
        fence: Callable[[str], None] | None = None,
    ) -> None:
        self._config = config
        self._who = config.label or f"rank {config.rank}"  # in log lines and save errors
        self._storage = storage
        self._dest = destination
        self._pool = pool
        self._serializer = serializer
        self._emit = emit
        self._fence = fence or (lambda what: None)
        """Rank 0: raises if another launch took the root over (called before a commit or a delete)."""
        self._queue: queue.Queue[SaveJob | DeleteJob | None] = queue.Queue()
        self._lock = threading.Lock()
        """Guards ``_thread``; held by the training thread only around calls that never wait on the writer
        thread, and never by the writer thread while a save is under way."""
        self._busy: set[str] = set()
        """Set operations are atomic; no lock (see ``_lock``)."""
        self.kept: frozenset[str] = frozenset()
        """Checkpoints retention counts as newest (``AsyncCheckpointer.keep``); replaced, never mutated."""
        self._deferred: set[str] = set()
        self._forced: set[str] = set()
        self._failed_attempts: dict[str, int] = {}
        """The last failed attempt of each checkpoint name that failed here. Every rank fails an attempt
        (the others learn of it from the failure record), so a retry is the same attempt everywhere, and
        an earlier attempt's failure records are not read as this one's."""
        # The thread runs only while there is work: non-daemon, so the interpreter never exits with a
        # save half done, yet an idle checkpointer that was never closed does not keep a process alive.
        self._thread: threading.Thread | None = None
        self._priority = WriterPriority()
        self._training_nice: int | None = None
        """The nice value of the thread that last submitted: what the writer never stays below."""

    def hurry(self) -> None:
        """The save being serialized stops yielding to training (``WriterPriority.finish``)."""
        self._priority.finish()

    @property
    def busy(self) -> frozenset[str]:
        """Names of the saves submitted and not yet committed or failed (a copy)."""
        return frozenset(self._busy)

    def submit(self, job: SaveJob | DeleteJob | None) -> None:
        """Queue ``job`` (None: let the thread exit once idle) and start the thread if it is not running.

        The thread starts outside ``_lock``, which guards only ``_thread``: ``Thread.start`` waits for
        the new thread, and nothing is held across that wait."""
        if isinstance(job, SaveJob):
            self._busy.add(job.name)
            self._training_nice = own_nice()
        with self._lock:
            self._queue.put(job)
            thread = None
            if self._thread is None:
                thread = self._thread = threading.Thread(
                    target=self._run, name=f"air-writer-r{self._config.rank}"
                )
        if thread is not None:
            thread.start()

    def stop(self, timeout_seconds: float) -> bool:
        """Finish queued jobs and let the thread exit; return whether it did within the bound."""
        self.submit(None)
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout_seconds)
        return thread is None or not thread.is_alive()

    def _run(self) -> None:
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
                if job.even_newest:
                    self._forced.add(job.name)
                self._run_deletes(None)
                job.ran.set()
            else:
                self._save(job)

    # -- one save, top to bottom ---------------------------------------------------------------
    def _save(self, job: SaveJob) -> None:
        run = _Progress(attempt=self._failed_attempts.get(job.name, 0) + 1)
        try:
            self._begin(job, run)
            written = self._serialize(job, run)
            self._upload(job, run)
            run.phase = "commit"
            t0 = time.monotonic()
            part = self._record_part(job, written, run)
            manifest = self._commit(job, part, run)
            run.leftovers = []
            run.seconds["commit"] = time.monotonic() - t0
        except Exception as exc:  # the thread boundary: handed to the save's handle
            self._fail(job, run, exc)
            return
        self._succeed(job, run, manifest)
        try:
            self._retain()
        except Exception:
            logger.warning(
                "%s: retention after %s failed; will retry after the next commit",
                self._who,
                job.name,
                exc_info=True,
            )

    def _begin(self, job: SaveJob, run: _Progress) -> None:
        """Refuse a committed name, then write the intent record before any data byte."""
        cfg = self._config
        self._fence(f"saving checkpoint {job.name!r}")
        commit.check_not_committed(self._storage, job.name)
        # The intent names the files before they exist, so a crash leaves a partial that retention finds.
        finalized = job.finalize.files if job.finalize is not None and cfg.rank == 0 else ()
        intent = tuple(FileEntry(rel, -1, 0, cfg.rank) for rel in (*job.files, *finalized))
        commit.write_part(self._storage, self._part(job, intent, run, complete=False))

    def _serialize(self, job: SaveJob, run: _Progress) -> dict[str, Written]:
        """Write the snapshot's files where the destination wants them.

        The serializing thread yields to training (a background priority) until the save's deadline,
        and runs at the training thread's priority after it and for the rest of the save.
        """
        self._phase(job, "serialize_start")
        t0 = time.monotonic()
        failed = job.snapshot.wait_copied()
        if failed is not None:
            raise failed
        temps = self._dest.temp_paths(job.files)
        run.leftovers = [*temps.values(), *self._dest.kept_locally(job.files)]
        run.following = self._dest.follow(temps)
        if run.following is not None:
            self._phase(job, "upload_start")
        priority = self._priority
        priority.begin(
            self._serializer.native_id, training_nice=self._training_nice, nbytes=job.snapshot.nbytes
        )
        try:
            reuse = spares.take(self._storage, temps) if self._config.recycle_files else frozenset()
            targets = Targets(temps, self._dest.fsync, reuse)
            written = self._serializer.write(job.snapshot, targets, tick=priority.check)
        finally:
            priority.finish()
        if run.following is not None:
            run.following.finish({rel: w.size for rel, w in written.items()})
        run.size = sum(w.size for w in written.values())
        if self._dest.cache_dir is not None:  # the peak: the cached saves, this one's files and its spill
            run.moved["staged"] += run.size
            run.staging_disk = folder_bytes(self._dest.cache_dir)
        else:  # a direct destination: the files are written at the root
            run.moved["in_place"] += run.size
        job.snapshot.remove_spill()
        self._dest.place(temps)
        run.leftovers = self._dest.kept_locally(job.files)
        run.seconds["staging"] = time.monotonic() - t0
        self._phase(job, "staged")
        return written

    def _upload(self, job: SaveJob, run: _Progress) -> None:
        """Copy staged files to the root, ``max_transfers`` at a time (nothing for a direct destination),
        or wait for the uploads that followed the serializer. ``upload_seconds`` is the time after
        staging until the files are at the root."""
        t0 = time.monotonic()
        if run.following is not None:
            run.phase = "upload"
            _count(run, run.following.wait())
            run.following = None
        else:
            staged = self._dest.to_upload(job.files)
            if not staged:
                return
            run.phase = "upload"
            self._phase(job, "upload_start")
            _count(run, self._dest.upload(staged))
        run.seconds["upload"] = time.monotonic() - t0
        self._phase(job, "uploaded")

    def _record_part(self, job: SaveJob, written: dict[str, Written], run: _Progress) -> PartRecord:
        """This rank's complete part record (written only when other ranks' parts must be merged)."""
        cfg = self._config
        entries = tuple(FileEntry(rel, written[rel].size, written[rel].crc32, cfg.rank) for rel in job.files)
        extents = {rel: [list(e) for e in w.extents] for rel, w in written.items() if w.extents}
        part = self._part(job, entries, run, complete=True, extents=extents)
        if cfg.world_size > 1:
            commit.write_part(self._storage, part)
            self._phase(job, "part_written")
        return part

    def _part(
        self,
        job: SaveJob,
        files: tuple[FileEntry, ...],
        run: _Progress,
        *,
        complete: bool,
        extents: dict[str, list[list[int]]] | None = None,
    ) -> PartRecord:
        """This rank's part record (the intent, or the complete one), naming this process: a rank waiting
        for it on the same host stops waiting when it died."""
        cfg, me = self._config, procfs.Process.this()
        return PartRecord(
            job.name,
            job.step,
            cfg.rank,
            cfg.launch_id,
            files,
            complete,
            extents or {},
            run.attempt,
            dict(run.moved) if complete else {},
            me.host,
            me.pid,
            me.started,
            me.space,
        )

    def _commit(self, job: SaveJob, part: PartRecord, run: _Progress) -> Manifest:
        """Rank 0: gather every part (and finalize) and write the manifest; other ranks: wait for it."""
        cfg, storage = self._config, self._storage
        if cfg.rank == 0:
            self._phase(job, "commit_start")
            parts = [part]
            if cfg.world_size > 1:
                parts = commit.wait_for_parts(
                    storage,
                    part,
                    world_size=cfg.world_size,
                    timeout_seconds=cfg.commit_timeout_seconds,
                    peers=cfg.peers,
                )
            extra = self._finalize(job.finalize, parts, run) if job.finalize is not None else ()
            for other in parts[1:]:  # the save's bytes moved, every rank's
                for key, n in other.moved.items():
                    run.moved[key] = run.moved.get(key, 0) + n
            manifest = Manifest(
                name=job.name,
                step=job.step,
                time=time.time(),
                world_size=cfg.world_size,
                launch_id=cfg.launch_id,
                files=(*(f for p in parts for f in p.files), *extra),
                versions=library_versions(),
                metadata=dict(job.metadata),
            )
            self._fence(f"committing checkpoint {job.name!r}")
            commit.write_manifest(storage, manifest)
        else:
            manifest = commit.wait_for_manifest(
                storage, part, timeout_seconds=cfg.commit_timeout_seconds, peers=cfg.peers
            )
        self._dest.remember(manifest)
        return manifest

    def _finalize(self, finalize: Finalize, parts: list[PartRecord], run: _Progress) -> tuple[FileEntry, ...]:
        """Write the finalizer's files the way this rank's data files went (placed, then uploaded)."""
        made = dict(finalize.make(parts))
        files = finalize.files
        if set(made) != set(files):
            raise RuntimeError(f"the finalizer made {sorted(made)}, not the announced {sorted(files)}")
        temps = self._dest.temp_paths(files)
        run.leftovers = [*temps.values(), *self._dest.kept_locally(files)]
        for rel, tmp in temps.items():
            with open(tmp, "wb") as f:
                f.write(made[rel])
                if self._dest.fsync:
                    os.fsync(f.fileno())
        self._dest.place(temps)
        where = "staged" if self._dest.cache_dir is not None else "in_place"
        run.moved[where] += sum(len(data) for data in made.values())
        _count(run, self._dest.upload(self._dest.to_upload(files)))
        run.leftovers = []
        return tuple(
            FileEntry(rel, len(data), zlib.crc32(data), self._config.rank) for rel, data in made.items()
        )

    def _succeed(self, job: SaveJob, run: _Progress, manifest: Manifest) -> None:
        self._phase(job, "committed")
        logger.info(
            "%s committed checkpoint %s (step %d, %d bytes) in %.2fs",
            self._who,
            job.name,
            job.step,
            run.size,
            time.monotonic() - job.called_at,
        )
        self._record(job, run)
        self._release(job)
        job.finish(CheckpointInfo(job.name, job.step, "committed", "", manifest), None)

    def _fail(self, job: SaveJob, run: _Progress, exc: Exception) -> None:
        cfg = self._config
        if run.following is not None:  # the uploads abort what they sent before the files go
            run.following.abandon()
        for leftover in run.leftovers:
            with contextlib.suppress(OSError):
                os.unlink(leftover)
        fix = ""
        if run.phase == "serialize" and isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            fix = f" {self._dest.disk_full_fix(exc)}"  # storage errors name their own fix
        error = SaveError(
            f"{self._who}: saving checkpoint {job.name!r} (step {job.step}) failed during {run.phase}: "
            f"{type(exc).__name__}: {str(exc).rstrip('.')}.{fix} "
            "The previous committed checkpoint is untouched.",
            step=job.step,
            phase=run.phase,
            rank=cfg.rank,
        )
        error.__cause__ = exc
        self._phase(job, "failed")
        if cfg.world_size > 1:
            self._failed_attempts[job.name] = run.attempt
            self._tell_others(job, run.attempt, str(error))
        self._record(job, run, error=str(error))
        self._release(job)
        job.finish(None, error)

    def _tell_others(self, job: SaveJob, attempt: int, error: str) -> None:
        """Record this rank's failure where the ranks waiting for its part or its commit look (best effort:
        the storage may be what failed; they then wait until ``commit_timeout_seconds``)."""
        cfg = self._config
        try:
            record = FailureRecord(job.name, job.step, cfg.rank, cfg.launch_id, attempt, error)
            commit.write_failure(self._storage, record)
        except Exception as exc:
            logger.warning(
                "%s: could not record for the other ranks that %s failed: %s", self._who, job.name, exc
            )

    # -- retention and deletes ----------------------------------------------------------------
    def _retain(self) -> None:
        """Rank 0: delete what retention picks and what was asked for, all from one listing."""
        if self._config.rank == 0:
            catalog = read_catalog(self._storage)  # the one listing of this commit
            victims = commit.retention_victims(
                catalog, keep_last=self._config.keep_last, busy=self.busy, kept=self.kept
            )
            for info in victims:
                catalog = self._delete(info, catalog)
            self._run_deletes(catalog)
        self._dest.trim(self._config.keep_last)

    def _run_deletes(self, catalog: Catalog | None) -> None:
        """Delete what was asked for, except the newest committed checkpoint: that one waits for a newer."""
        if not self._deferred:
            return
        try:
            catalog = catalog or read_catalog(self._storage)
            newest = catalog.newest_committed
            for info in catalog.infos:
                if info.name not in self._deferred:
                    continue
                if newest is not None and info.name == newest.name and info.name not in self._forced:
                    logger.info("%s: keeping %s until a newer checkpoint commits", self._who, info.name)
                    continue
                catalog = self._delete(info, catalog)
                self._deferred.discard(info.name)
            self._deferred &= {i.name for i in catalog.infos}
            self._forced &= self._deferred
        except Exception:
            logger.warning("%s: deleting %s failed; will retry", self._who, self._deferred, exc_info=True)

    def _delete(self, info: CheckpointInfo, catalog: Catalog) -> Catalog:
        self._fence(f"deleting checkpoint {info.name!r}")
        self._emit(PhaseEvent("retention_start", info.name, info.step, self._config.rank))
        nbytes = catalog.bytes_of(info)
        catalog = commit.delete_checkpoint(self._storage, info, catalog, recycle=self._config.recycle_files)
        self._dest.forget(info.name)
        self._emit(PhaseEvent("retention_deleted", info.name, info.step, self._config.rank))
        self._emit(DeleteRecord(info.name, info.step, nbytes))
        return catalog

    # -- bookkeeping ---------------------------------------------------------------------------
    def _phase(self, job: SaveJob, phase: Phase) -> None:
        self._emit(PhaseEvent(phase, job.name, job.step, self._config.rank))

    def _release(self, job: SaveJob) -> None:
        """End the save's claim: its buffer goes back to the pool (so the next save may snapshot)."""
        if not job.released:
            job.released = True
            job.snapshot.wait_copied()
            job.snapshot.remove_spill()
            self._busy.discard(job.name)
            self._pool.give_back(job.snapshot.buffer)

    def _record(self, job: SaveJob, run: _Progress, error: str = "") -> None:
        self._emit(
            SaveRecord(
                name=job.name,
                step=job.step,
                rank=self._config.rank,
                wait_seconds=job.wait_seconds,
                blocking_seconds=job.blocking_seconds,
                staging_seconds=run.seconds["staging"],
                upload_seconds=run.seconds["upload"],
                commit_seconds=run.seconds["commit"],
                total_seconds=time.monotonic() - job.called_at,
                bytes=run.size,
                spilled_bytes=job.snapshot.spilled_bytes,
                error=error,
                staged_bytes=run.moved["staged"],
                uploaded_bytes=run.moved["uploaded"],
                linked_bytes=run.moved["linked"],
                in_place_bytes=run.moved["in_place"],
                staging_disk_bytes=run.staging_disk,
            )
        )


def _count(run: _Progress, puts: list[Put]) -> None:
    for put in puts:
        run.moved["linked" if put.linked else "uploaded"] += put.size


def folder_bytes(path: str) -> int:
    """The bytes of every file below ``path`` (a staging folder: a few files per checkpoint)."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):  # another rank of the node may remove one meanwhile
                total += os.lstat(os.path.join(folder, name)).st_size
    return total
