"""Every path under a checkpoint root, in one place: relative POSIX paths, no I/O.

Other modules ask here instead of spelling a path, so the on-disk format is read in one file: a
rank's data file (default ``<name>/rank-00000.pt``), ``.air/<name>/rank-00000.json`` (part record:
intent, then complete), ``.air/<name>/failed-rank-00000.json`` (that part failed),
``.air/<name>/manifest.json`` (the commit, last), ``.air/lease.json`` and the
``.air-events/`` log. It builds and recognises paths, never checks what is there. Key decision: the
format is frozen; a new name is added here, an existing one never changes.
"""

from __future__ import annotations

import os
import posixpath

META_DIR = ".air"
"""Commit records: one folder per checkpoint, plus the lease."""
EVENTS_DIR = ".air-events"
"""Rank 0's goodput event log, one folder per launch."""
JOURNAL_DIR = ".air-journal"
"""In a root's node-local folder (``AsyncCheckpointer.local_dir``): rank 0's journal of each launch's
goodput log, until the log is all at the root."""
LEASE_PATH = f"{META_DIR}/lease.json"
RESERVED_DIRS = (META_DIR, EVENTS_DIR)
"""Folders that stay even when a delete empties them: another rank may be about to write into them."""
TEMP_MARK = ".air-tmp"
"""In the name of every temp file air_core writes: ``<file>.air-tmp`` while a staged file is
serialized, ``.<file>.air-tmp-<id>`` beside a file being placed (a killed process may leave one)."""
SPARE_DIR = ".air-spare"
"""The files of a root's dropped checkpoint kept to be overwritten by its next save's (``recycle_files``:
the local tier's own root), ``.air-spare/<k>``: the k-th of its files in path order."""
PROBE_PREFIX = ".probe-"
"""Names a write probe (under ``.air/`` at the root, or in a local folder), removed right away."""
_MANIFEST = "manifest.json"
_RANK = "rank-"


def default_name(step: int) -> str:
    """The checkpoint name of ``save(step=...)`` when the caller gives none (zero-padded for listings)."""
    return f"step-{step:09d}"


def default_file(name: str, rank: int) -> str:
    """The file one rank writes when the caller names none."""
    return f"{name}/{_RANK}{rank:05d}.pt"


def record_dir(name: str) -> str:
    """The folder of checkpoint ``name``'s records (part records and manifest)."""
    return f"{META_DIR}/{name}"


def rank_state_path(name: str, rank: int) -> str:
    """Rank ``rank``'s session state in checkpoint ``name``, for frameworks that write one file from
    rank 0 only (Lightning); a data file, not a part record (those end in ``.json``)."""
    return f"{record_dir(name)}/part-rank-{rank:05d}.pt"


def manifest_path(name: str) -> str:
    """The commit record of checkpoint ``name``."""
    return f"{record_dir(name)}/{_MANIFEST}"


def part_path(name: str, rank: int) -> str:
    """Rank ``rank``'s part record of checkpoint ``name``."""
    return f"{record_dir(name)}/{_RANK}{rank:05d}.json"


def failure_path(name: str, rank: int) -> str:
    """Written by rank ``rank`` when its part of checkpoint ``name`` failed, so that the ranks waiting for
    that part (rank 0) or for the commit (the others) stop waiting. Not a part record."""
    return f"{record_dir(name)}/failed-{_RANK}{rank:05d}.json"


def is_failure_record(rel: str, name: str) -> bool:
    """Whether ``rel`` is a ``failure_path`` of checkpoint ``name``."""
    head, _, tail = rel.rpartition("/")
    return head == record_dir(name) and tail.startswith(f"failed-{_RANK}") and tail.endswith(".json")


def probe_path(token: str) -> str:
    """The probe a writable-root check writes and removes."""
    return f"{META_DIR}/{PROBE_PREFIX}{token}"


def hang_stacks_path(launch_id: str, rank: int) -> str:
    """Every thread's stack of rank ``rank`` when the hang watchdog stopped it (``air_core.health``)."""
    return f"{EVENTS_DIR}/hang-{launch_id}-rank{rank:05d}.txt"


def hang_record_path(launch_id: str, rank: int) -> str:
    """The JSON record of that hang (rank, host, step, seconds without progress), read by ``air report``."""
    return f"{EVENTS_DIR}/hang-{launch_id}-rank{rank:05d}.json"


def is_hang_record(rel: str) -> bool:
    """Whether ``rel`` is a ``hang_record_path``."""
    head, _, tail = rel.rpartition("/")
    return head == EVENTS_DIR and tail.startswith("hang-") and tail.endswith(".json")


def spare_path(index: int) -> str:
    """The ``index``-th spare file of a root that recycles its files (``SPARE_DIR``)."""
    return f"{SPARE_DIR}/{index:05d}"


def checkpoint_of(rel: str) -> str | None:
    """The checkpoint whose record folder holds ``rel`` (None for anything else, the lease included)."""
    parts = rel.split("/")
    return parts[1] if len(parts) >= 3 and parts[0] == META_DIR else None


def is_part_record(rel: str, name: str) -> bool:
    """Whether ``rel`` is one of the part records of checkpoint ``name``."""
    head, _, tail = rel.rpartition("/")
    return head == record_dir(name) and tail.startswith(_RANK) and tail.endswith(".json")


def unsafe_reason(path: object) -> str:
    """Why ``path`` is not a safe relative POSIX path inside a root, or ``""``.

    Refused: empty, absolute, ``..``/``.``/empty segments, backslashes, a drive or scheme.
    """
    parts = path.split("/") if isinstance(path, str) else []
    if (
        not isinstance(path, str)
        or not path
        or posixpath.normpath(path) != path
        or path.startswith("/")
        or "\\" in path
        or ":" in parts[0]
        or any(part in ("", ".", "..") for part in parts)
    ):
        return "paths in a checkpoint must be relative, without '..', '.', '\\' or a drive/scheme"
    return ""


def local_path(folder: str, rel: str) -> str:
    """Where ``rel`` lives below a local ``folder`` (the staging folder, the local cache)."""
    return os.path.join(folder, *rel.split("/"))
