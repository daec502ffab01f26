"""Agree that every rank's part is at the destination, then commit; decide what retention deletes.

Coordination goes through the storage, never through the training process group (collectives from
a background thread can deadlock or reorder the training's own): each rank writes a part record
after its files are uploaded; rank 0 polls for all of them (same launch id, same step) and then writes
the manifest, last; the other ranks poll for the manifest. A rank that dies before its record leaves
the checkpoint uncommitted, so the previous one stays the newest. A committed location is never
written again, and retention deletes only committed checkpoints older than the newest ``keep_last``,
manifest first (so a reader never sees a committed checkpoint with files missing).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from .errors import CorruptCheckpointError, StorageError
from .manifest import META_DIR, CheckpointInfo, Manifest, PartRecord, manifest_path, part_path
from .recovery import part_files
from .storage import Storage

logger = logging.getLogger(__name__)


def write_part(storage: Storage, record: PartRecord) -> None:
    storage.write_bytes(part_path(record.name, record.rank), record.to_json())


def _poll(what: str, timeout_seconds: float, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_seconds
    delay = 0.02
    while not check():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_seconds:g}s")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def wait_for_parts(
    storage: Storage, *, name: str, step: int, launch_id: str, world_size: int, timeout_seconds: float
) -> list[PartRecord]:
    """Rank 0: block until every rank's complete part record of this save is present."""
    found: dict[int, PartRecord] = {}

    def all_there() -> bool:
        for rel in storage.sizes(f"{META_DIR}/{name}"):
            if not rel.rsplit("/", 1)[-1].startswith("rank-"):
                continue
            with contextlib.suppress(FileNotFoundError, CorruptCheckpointError):
                r = PartRecord.from_json(storage.read_bytes(rel), where=storage.display(rel))
                if r.complete and r.launch_id == launch_id and r.step == step and r.name == name:
                    found[r.rank] = r
        return len(found) == world_size

    try:
        _poll(f"parts of all {world_size} ranks for checkpoint {name!r}", timeout_seconds, all_there)
    except TimeoutError as exc:
        missing = sorted(set(range(world_size)) - set(found))
        raise StorageError(f"{exc}: ranks {missing} never uploaded theirs (did they crash?)") from exc
    return [found[r] for r in range(world_size)]


def wait_for_manifest(storage: Storage, *, name: str, launch_id: str, timeout_seconds: float) -> Manifest:
    """Ranks > 0: block until rank 0 has committed this launch's checkpoint ``name``."""
    rel = manifest_path(name)
    try:
        _poll(f"the commit of checkpoint {name!r} by rank 0", timeout_seconds, lambda: storage.exists(rel))
    except TimeoutError as exc:
        raise StorageError(str(exc)) from exc
    manifest = Manifest.from_json(storage.read_bytes(rel), where=storage.display(rel))
    if manifest.launch_id != launch_id:
        raise StorageError(f"checkpoint {name!r} was committed by another launch ({manifest.launch_id})")
    return manifest


def write_manifest(storage: Storage, manifest: Manifest) -> None:
    """Commit: write the manifest, refusing to overwrite a committed checkpoint."""
    rel = manifest_path(manifest.name)
    if storage.exists(rel):
        raise StorageError(
            f"checkpoint {manifest.name!r} is already committed at {storage.display(rel)}; a committed "
            "location is never overwritten. Save under a new name (the default name includes the step)."
        )
    paths = [f.path for f in manifest.files]
    if len(paths) != len(set(paths)):
        raise StorageError(
            f"checkpoint {manifest.name!r}: two ranks wrote the same file path: {sorted(paths)}"
        )
    storage.write_bytes(rel, manifest.to_json())


def retention_victims(infos: list[CheckpointInfo], *, keep_last: int, busy: set[str]) -> list[CheckpointInfo]:
    """What may be deleted now: committed checkpoints beyond the newest ``keep_last``, and partial
    ones (with a part record) older than the newest commit that no save of ours is still writing."""
    committed = [i for i in infos if i.status == "committed"]
    if not committed:
        return []
    newest_step = committed[-1].step
    old = committed[:-keep_last] if len(committed) > keep_last else []
    # A partial without a readable part record (step -1) may be a save whose first record another
    # rank is writing this instant: it is left alone (it holds no data file yet).
    stale = [i for i in infos if i.status == "partial" and 0 <= i.step < newest_step and i.name not in busy]
    return old + stale


def delete_checkpoint(storage: Storage, info: CheckpointInfo, *, others: list[CheckpointInfo]) -> None:
    """Delete one checkpoint: the manifest first, then its files, then its records.

    A file that another checkpoint in ``others`` also names (a file rewritten in place, like Lightning's
    ``last.ckpt``) is left alone: it belongs to that checkpoint now.
    """
    storage.remove(manifest_path(info.name))
    files = [f.path for f in info.manifest.files] if info.manifest else part_files(storage, info.name)
    shared = {f.path for o in others if o.name != info.name and o.manifest for f in o.manifest.files}
    shared |= {
        p for o in others if o.name != info.name and o.manifest is None for p in part_files(storage, o.name)
    }
    for path in files:
        if path not in shared:
            storage.remove(path)
    storage.remove(f"{META_DIR}/{info.name}")
    logger.info("deleted checkpoint %s (step %d, %s)", info.name, info.step, info.status)
