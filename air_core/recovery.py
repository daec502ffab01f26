"""Choose the checkpoint to restore and hand back verified local copies of its files.

``restore`` walks the committed checkpoints newest first (by manifest step) and returns the first
whose files verify, skipping a corrupt one with a warning that says why; "no checkpoint yet"
(``FileNotFoundError``) and "none usable" (``CorruptCheckpointError`` naming each) stay distinct.
Where the bytes come from (the root in place, the local cache, a download) is the destination's job
(``staging.py``), what is under the root is ``catalog.py``'s; this module never writes the root.
``load_file`` memory-maps the verified file (``torch.load(mmap=True)``): the tensors read straight from
the page cache into ``load_state_dict``, so a restore never holds a second full copy of the state.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .catalog import scan, size_problem
from .checksum import file_crc32
from .errors import ConfigError, CorruptCheckpointError
from .events import Emitter, PhaseEvent, RestoreRecord
from .manifest import CheckpointInfo, FileEntry, Manifest
from .staging import Destination, open_destination
from .storage import Storage

__all__ = ["LocalCheckpoint", "fetch", "file_crc32", "load_file", "restore", "scan", "size_problem", "verify"]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalCheckpoint:
    """Verified local copies of some files of a committed checkpoint (from ``AsyncCheckpointer.fetch``)."""

    info: CheckpointInfo
    paths: dict[str, str]
    """Path relative to the root -> local file."""
    source: Literal["local", "cache", "remote"]


def link_files(paths: dict[str, str], folder: str, view: str) -> None:
    """Link into the local folder ``view`` exactly the files of ``paths`` (root-relative path -> local
    file) under ``folder`` (``""``: all), at their paths below it: a framework's loader handed ``view``
    reads one commit's files and never a leftover beside them."""
    for rel, local in paths.items():
        if folder and not rel.startswith(f"{folder}/"):
            continue
        target = os.path.join(view, *(rel[len(folder) + 1 :] if folder else rel).split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.path.abspath(local), target)


def one_restore(records: list[RestoreRecord], seconds: float) -> RestoreRecord:
    """``records`` (the fetches and loads of one restore, in order) as one record of ``seconds`` in all.

    The bytes add up; the source is the farthest any file came from; finding and fetching add up, and
    the rest of ``seconds`` (unpickling, DCP reading slices, copying into the model) is load time.
    """
    sources = {r.source for r in records}
    source: Literal["local", "cache", "remote"] = next(
        s for s in ("remote", "cache", "local") if s in sources
    )
    find, fetch = sum(r.find_seconds for r in records), sum(r.fetch_seconds for r in records)
    first = records[0]
    return RestoreRecord(
        first.name,
        first.step,
        first.rank,
        seconds,
        source,
        sum(r.bytes for r in records),
        find,
        fetch,
        load_seconds=max(seconds - find - fetch, 0.0),
    )


def restore(
    storage: Storage,
    dest: Destination,
    info: CheckpointInfo | None,
    *,
    ranks: set[int],
    max_transfers: int,
    rank: int,
    emit: Emitter,
    files: set[str] | None = None,
) -> tuple[LocalCheckpoint, RestoreRecord]:
    """Local verified copies of ``ranks``' files of ``info`` (None: the newest committed that verifies),
    or of ``files`` (paths under the root) when given (every one must be in the manifest).

    Emits ``restore_start`` before each candidate is fetched; returns the ``RestoreRecord`` of the one
    used for the caller to emit (``load`` adds its unpickling time first).

    Raises:
        FileNotFoundError: there is no committed checkpoint under the root.
        CorruptCheckpointError: ``info`` (or every committed checkpoint) fails verification.
    """
    started = time.monotonic()
    problems: list[str] = []
    candidates = [info] if info is not None else _candidates(storage, rank, problems)
    found = time.monotonic() - started
    for cand in candidates:
        if cand.manifest is None:
            raise CorruptCheckpointError(
                f"load({cand.name!r}): {cand.status} checkpoint ({cand.reason}); only committed "
                "checkpoints load.",
                path=storage.display(cand.name),
                reason=cand.reason or cand.status,
            )
        if files is None:
            entries = [f for f in cand.manifest.files if f.rank in ranks]
        else:
            entries = [f for f in cand.manifest.files if f.path in files]
            if missing := files - {e.path for e in entries}:
                raise CorruptCheckpointError(
                    f"load({cand.name!r}): the manifest names no file {sorted(missing)}",
                    path=storage.display(cand.name),
                    reason="file not in the manifest",
                )
        emit(PhaseEvent("restore_start", cand.name, cand.step, rank))
        fetching = time.monotonic()
        try:
            paths, source = dest.fetch(cand.manifest, entries, max_transfers=max_transfers)
        except CorruptCheckpointError as exc:
            if info is not None:
                raise
            logger.warning("rank %d: skipping checkpoint %s: %s", rank, cand.name, exc)
            problems.append(f"{cand.name}: {exc.reason}")
            continue
        done = time.monotonic()
        size = sum(e.size for e in entries)
        record = RestoreRecord(
            cand.name, cand.step, rank, done - started, source, size, found, fetch_seconds=done - fetching
        )
        logger.info(
            "rank %d fetched %s (step %d) from %s in %.2fs",
            rank,
            cand.name,
            cand.step,
            source,
            record.seconds,
        )
        return LocalCheckpoint(cand, paths, source), record
    raise CorruptCheckpointError(
        f"no committed checkpoint under {storage.display()} verifies: {'; '.join(problems)}",
        path=storage.display(),
        reason="all corrupt",
    )


def _candidates(storage: Storage, rank: int, problems: list[str]) -> list[CheckpointInfo]:
    """Committed checkpoints, newest first; corrupt ones newer than all of them are reported."""
    candidates = []
    for found in reversed(scan(storage)):
        if found.status == "committed":
            candidates.append(found)
        elif found.status == "corrupt" and not candidates:  # newer than any we may load: say why
            logger.warning("rank %d: skipping checkpoint %s: %s", rank, found.name, found.reason)
            problems.append(f"{found.name}: {found.reason}")
    if not candidates:
        why = f" ({'; '.join(problems)})" if problems else ""
        raise FileNotFoundError(f"no committed checkpoint under {storage.display()}{why}")
    return candidates


def fetch(
    storage: Storage,
    cache_dir: str | None,
    manifest: Manifest,
    entries: list[FileEntry],
    *,
    max_transfers: int,
) -> tuple[dict[str, str], Literal["local", "cache", "remote"]]:
    """Local verified copies of ``entries`` for a tool: in place when ``cache_dir`` is None (local root).

    Raises:
        CorruptCheckpointError: a file does not match its manifest entry even after a fresh download.
    """
    return open_destination(storage, cache_dir).fetch(manifest, entries, max_transfers=max_transfers)


def verify(storage: Storage, info: CheckpointInfo, cache_dir: str | None, *, max_transfers: int) -> str:
    """Re-check every file of a committed checkpoint (sizes and checksums); return the problem or ``""``."""
    return verify_with(open_destination(storage, cache_dir), info, max_transfers=max_transfers)


def verify_with(dest: Destination, info: CheckpointInfo, *, max_transfers: int) -> str:
    if info.manifest is None:
        return info.reason or "not committed"
    try:
        dest.fetch(info.manifest, list(info.manifest.files), max_transfers=max_transfers)
    except CorruptCheckpointError as exc:
        return str(exc)
    return ""


def load_file(local: LocalCheckpoint, *, rank: int, map_location: Any, weights_only: bool | None) -> Any:
    """``torch.load`` the one verified file of ``rank`` in ``local``, memory-mapped.

    The tensors map the file privately (copy on write: changing them never changes the file), so
    ``load_state_dict`` copies from the page cache and no anonymous copy of the whole state is made.
    The files are written once and replaced by rename, never in place, so the mapping stays valid.

    Raises:
        ConfigError: ``local`` holds no single file of ``rank``, or ``weights_only=True`` refuses
            an object in it (the message says which, and the fix).
    """
    name = local.info.name
    if len(local.paths) != 1:
        manifest = local.info.manifest
        assert manifest is not None
        raise ConfigError(
            f"load({name!r}) on rank {rank}: the checkpoint was written by {manifest.world_size} rank(s) "
            f"and holds {len(local.paths)} file(s) of this rank; resume with the world size it was saved "
            "with (or use fetch() for multi-file parts)."
        )
    (path,) = local.paths.values()
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=True)
    except pickle.UnpicklingError as exc:
        if weights_only is False:
            raise
        lines = [line.strip() for line in str(exc).splitlines()]
        why = next((line for line in lines if "Unsupported global" in line), lines[0] if lines else "")
        raise ConfigError(
            f"load({name!r}): the checkpoint holds objects that weights_only=True refuses ({why}); "
            "unpickling them could run code. If you trust this checkpoint, pass weights_only=False."
        ) from exc
