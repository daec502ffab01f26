"""Agree that every rank's part is at the destination, commit it, and delete what retention picks.

Coordination goes through the storage, never the training process group (a collective from a
background thread can deadlock or reorder the training's own): rank 0 reads every rank's part record
at its known path, then writes the manifest, last; other ranks wait for the manifest. No wait lists
(``exists`` on an object store may list), so a commit lists the root once, for retention, which
deletes manifest first. A committed location is never written again. It writes no data files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from . import layout, liveness, procfs, spares
from .catalog import Catalog
from .errors import CorruptCheckpointError, StorageError
from .manifest import CheckpointInfo, FailureRecord, Manifest, PartRecord
from .storage import Storage

logger = logging.getLogger(__name__)
NOTE_AFTER_SECONDS = 30.0
"""How long a commit waits before it logs what it waits for (then every minute)."""


def write_part(storage: Storage, record: PartRecord) -> None:
    """Write (or overwrite: intent, then complete) this rank's part record."""
    storage.write_bytes(layout.part_path(record.name, record.rank), record.to_json())


def write_failure(storage: Storage, record: FailureRecord) -> None:
    """This rank's part of ``record``'s attempt failed: the ranks waiting for it stop now, not at
    ``commit_timeout_seconds`` (and their next save would wait for the buffers they hold)."""
    storage.write_bytes(layout.failure_path(record.name, record.rank), record.to_json())


def gather_peers(
    rank: int, world_size: int, gather: Callable[[Any], list[Any]]
) -> tuple[procfs.Process, ...]:
    """Every rank's process (``CheckpointerConfig.peers``), through ``gather`` (a collective: every rank
    calls it), each with its liveness beacon; then this rank watches those on other hosts that its waits
    depend on: rank 0 every rank (their parts), the others rank 0 (its manifest)."""
    me = procfs.Process.this()
    beacon = liveness.serve(me.hello, toward=os.environ.get("MASTER_ADDR", ""), limit=world_size)
    peers = tuple(gather(dataclasses.replace(me, beacon=beacon)))
    mine = peers[rank]
    liveness.watch(
        (p.beacon, p.hello)
        for r, p in enumerate(peers)
        if r != rank and 0 in (r, rank) and p.space != mine.space
    )
    return peers


def _failed(storage: Storage, own: PartRecord, rank: int) -> str | None:
    """The error rank ``rank`` recorded for ``own``'s attempt of this launch's save, if it failed there."""
    data = storage.read_if_present(layout.failure_path(own.name, rank))
    record = FailureRecord.from_json(data) if data is not None else None
    if record is None or not _same_save(record, own):
        return None  # none, or another launch's save of the same name, or an earlier attempt
    return record.error


def check_not_committed(storage: Storage, name: str) -> None:
    """Raise ``StorageError`` if checkpoint ``name`` is committed: its location is never written again."""
    rel = layout.manifest_path(name)
    if storage.read_if_present(rel) is not None:
        raise StorageError(
            f"checkpoint {name!r} is already committed at {storage.display(rel)}; a committed location "
            "is never written again. Save under a new name (the default name includes the step)."
        )


def _poll(what: str, timeout_seconds: float, check: Callable[[], bool], waiting: Callable[[], str]) -> None:
    """Call ``check`` until it is true or ``timeout_seconds`` passed (``TimeoutError``), saying what it still
    waits for (``waiting``) after ``NOTE_AFTER_SECONDS`` and every minute after: a job whose save waits
    for a rank that is gone otherwise sits silent at its end or stop until the bound."""
    start = time.monotonic()
    deadline, note = start + timeout_seconds, start + NOTE_AFTER_SECONDS
    delay = 0.02
    while not check():
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_seconds:g}s")
        if now >= note:
            logger.warning(
                "still waiting for %s after %.0f s (%s; it fails after commit_timeout_seconds=%g)",
                what,
                now - start,
                waiting(),
                timeout_seconds,
            )
            note += 60.0
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def wait_for_parts(
    storage: Storage,
    own: PartRecord,
    *,
    world_size: int,
    timeout_seconds: float,
    peers: tuple[procfs.Process, ...] = (),
) -> list[PartRecord]:
    """Rank 0: block until every rank's complete part record of ``own``'s save is present.

    Reads only the records of ranks still missing, at their known paths, each round. Stops at a rank that
    recorded a failure (or whose death a rank of its host recorded), or whose process (``peers``, else
    its intent record) died on this host: its part can never come, and the launcher may send the
    survivors no signal (Lightning's own, a plain script) or wait for them (torchrun, 30 s).
    """
    found = {own.rank: own}

    def all_there() -> bool:
        for rank in range(world_size):
            if rank in found:
                continue
            record = _part(storage, own, rank)
            if record is None or not record.complete:
                error = _failed(storage, own, rank)
                if error is not None:
                    raise StorageError(f"rank {rank} failed its part of checkpoint {own.name!r}: {error}")
                process = peers[rank] if peers else record.process if record is not None else None
                if process is not None and process.gone():
                    record = _part(storage, own, rank)  # it may have finished its part just before it ended
                    if record is None or not record.complete:
                        raise StorageError(_died(rank, process, own))
            if record is not None and record.complete:
                found[rank] = record
        return len(found) == world_size

    def missing() -> list[int]:
        return sorted(set(range(world_size)) - set(found))

    def waiting() -> str:
        return f"no part yet from ranks {missing()}"

    try:
        _poll(
            f"parts of all {world_size} ranks for checkpoint {own.name!r}",
            timeout_seconds,
            all_there,
            waiting,
        )
    except TimeoutError as exc:
        raise StorageError(f"{exc}: ranks {missing()} never uploaded theirs (did they crash?)") from exc
    return [found[r] for r in range(world_size)]


def _part(storage: Storage, own: PartRecord, rank: int) -> PartRecord | None:
    """Rank ``rank``'s record (intent or complete) of ``own``'s save; None while there is none (or only an
    unreadable one, or another save's)."""
    rel = layout.part_path(own.name, rank)
    with contextlib.suppress(FileNotFoundError, CorruptCheckpointError):
        record = PartRecord.from_json(storage.read_bytes(rel), where=storage.display(rel))
        if _same_save(record, own):
            return record
    return None


def _died(rank: int, process: procfs.Process, own: PartRecord) -> str:
    return f"rank {rank} ({process.describe()}) died before its part of checkpoint {own.name!r} was in"


def _same_save(record: PartRecord | FailureRecord, own: PartRecord) -> bool:
    """Whether ``record`` belongs to ``own``'s save: this launch, step and name, and this attempt of it."""
    return (record.launch_id, record.step, record.name, record.attempt) == (
        own.launch_id,
        own.step,
        own.name,
        own.attempt,
    )


def wait_for_manifest(
    storage: Storage, own: PartRecord, *, timeout_seconds: float, peers: tuple[procfs.Process, ...] = ()
) -> Manifest:
    """Ranks > 0: block until rank 0 has committed this launch's checkpoint ``own.name``. Stops when rank 0
    failed this attempt of it, or its process died on this host before the commit; and when another rank
    of this host died before its part (``peers``): its death is then recorded where rank 0, on another
    host, looks for its failure (``_witness``)."""
    name, launch_id = own.name, own.launch_id
    rel = layout.manifest_path(name)
    data: list[bytes] = []
    writer = [peers[0]] if peers else []  # rank 0's process (without peers, once its record is found)
    here = [r for r, p in enumerate(peers) if r not in (0, own.rank) and p.space == peers[own.rank].space]

    def committed() -> bool:
        found = storage.read_if_present(rel)
        if found is not None:
            data.append(found)
            return True
        error = _failed(storage, own, 0)
        if error is not None:
            raise StorageError(f"rank 0 did not commit checkpoint {name!r}: {error}")
        if not writer and (record := _part(storage, own, 0)) is not None:
            writer.append(record.process)
        if writer and writer[0].gone():
            found = storage.read_if_present(rel)  # it may have committed just before it ended
            if found is None:
                raise StorageError(
                    f"rank 0 ({writer[0].describe()}) died before it committed checkpoint {name!r}"
                )
            data.append(found)
            return True
        for rank in [r for r in here if peers[r].gone()]:
            _witness(storage, own, rank, peers[rank])
            here.remove(rank)  # its part was in: the commit goes on without it
        return False

    def waiting() -> str:
        return "rank 0 has written neither the manifest nor a failure record"

    try:
        _poll(f"the commit of checkpoint {name!r} by rank 0", timeout_seconds, committed, waiting)
    except TimeoutError as exc:
        raise StorageError(str(exc)) from exc
    manifest = Manifest.from_json(data[0], where=storage.display(rel))
    if manifest.launch_id != launch_id:
        raise StorageError(f"checkpoint {name!r} was committed by another launch ({manifest.launch_id})")
    return manifest


def _witness(storage: Storage, own: PartRecord, rank: int, process: procfs.Process) -> None:
    """Rank ``rank`` of this host died: if its part of ``own``'s save is not complete, the save cannot
    commit. Record that as its failure (rank 0, on another host, reads it as if it had written it), and
    raise ``StorageError``."""
    record = _part(storage, own, rank)
    if record is not None and record.complete:
        return
    error = f"{_died(rank, process, own)} (seen by rank {own.rank}, on its host)"
    write_failure(storage, FailureRecord(own.name, own.step, rank, own.launch_id, own.attempt, error))
    raise StorageError(error)


def write_manifest(storage: Storage, manifest: Manifest) -> None:
    """Commit: write the manifest, refusing to overwrite a committed checkpoint."""
    check_not_committed(storage, manifest.name)
    paths = [f.path for f in manifest.files]
    if len(paths) != len(set(paths)):
        raise StorageError(
            f"checkpoint {manifest.name!r}: two ranks wrote the same file path: {sorted(paths)}"
        )
    storage.write_bytes(layout.manifest_path(manifest.name), manifest.to_json())


def retention_victims(
    catalog: Catalog, *, keep_last: int, busy: frozenset[str], kept: frozenset[str] = frozenset()
) -> list[CheckpointInfo]:
    """What may be deleted now: committed checkpoints beyond the newest ``keep_last``, and partial
    ones (with a part record) older than the newest commit that no save of ours is still writing.

    ``kept`` (a framework's best checkpoint): counted among the ``keep_last`` as if newest, as
    transformers' ``save_total_limit`` counts it; the newest commit is kept as well, always."""
    committed = catalog.committed
    if not committed:
        return []
    newest = committed[-1]
    newest_step = newest.step
    ranked = [i for i in committed if i.name not in kept] + [i for i in committed if i.name in kept]
    old = [i for i in ranked[: max(len(ranked) - keep_last, 0)] if i is not newest]
    # A partial without a readable part record (step -1) may be a save whose first record another
    # rank is writing this instant: it is left alone (it holds no data file yet).
    stale = [
        i for i in catalog.infos if i.status == "partial" and 0 <= i.step < newest_step and i.name not in busy
    ]
    return old + stale


def delete_checkpoint(
    storage: Storage,
    info: CheckpointInfo,
    catalog: Catalog,
    *,
    recycle: bool = False,
    cached: bool = False,
) -> Catalog:
    """Delete one checkpoint: the manifest first, then its files (``recycle``: set aside for the next
    save to write over, ``spares.py``), then its records; return the rest. ``cached``: ``storage`` is a
    staging folder's cache, whose copies come and go unseen by users (logged at DEBUG, never as a
    deleted checkpoint: the root's is still there).

    A file that another checkpoint in ``catalog`` also names is left alone (``Catalog.owned_files``).
    """
    storage.remove(layout.manifest_path(info.name))
    files = list(catalog.owned_files(info))
    if recycle:
        spares.set_aside(storage, files)
    else:
        for path in files:
            storage.remove(path)
    storage.remove(layout.record_dir(info.name))
    if cached:
        logger.debug("dropped the staging cache's copy of checkpoint %s (step %d)", info.name, info.step)
    else:
        logger.info("deleted checkpoint %s (step %d, %s)", info.name, info.step, info.status)
    return catalog.without(info.name)


def keep_newest(storage: Storage, catalog: Catalog, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints that have a manifest (the local cache)."""
    held = [i for i in catalog.infos if i.manifest is not None]
    for info in held[: max(len(held) - keep_last, 0)]:
        catalog = delete_checkpoint(storage, info, catalog, cached=True)
