"""Find checkpoints under a root, judge them, and read one back verified.

``scan`` lists the root once and returns every checkpoint with its status: ``committed`` (manifest
present, every file there at its recorded size), ``corrupt`` (manifest unreadable or a file missing or
of the wrong size) or ``partial`` (no manifest: a save that never committed). Checkpoints are ordered
by their manifest's step, never by folder name or mtime. ``fetch`` returns a local, checksum-verified
copy of one file: the destination itself when it is local, else the local cache when the cached
manifest is byte-identical to the committed one, else a fresh download into the cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from .errors import CorruptCheckpointError
from .manifest import META_DIR, CheckpointInfo, FileEntry, Manifest, PartRecord, manifest_path
from .storage import Storage

logger = logging.getLogger(__name__)
_CHUNK = 8 << 20


def scan(storage: Storage) -> list[CheckpointInfo]:
    """Every checkpoint under the root, oldest step first (one fresh listing, small reads)."""
    sizes = storage.sizes()
    names = sorted(
        {rel.split("/")[1] for rel in sizes if rel.startswith(f"{META_DIR}/") and rel.count("/") >= 2}
    )
    infos = [_judge(storage, name, sizes) for name in names]
    return sorted(infos, key=lambda i: (i.step, i.time or 0.0, i.name))


def _judge(storage: Storage, name: str, sizes: dict[str, int]) -> CheckpointInfo:
    mpath = manifest_path(name)
    if mpath not in sizes:
        records = _part_records(storage, name, sizes)
        step = max((r.step for r in records), default=-1)
        return CheckpointInfo(name, step, "partial", f"no manifest ({len(records)} part record(s) found)")
    try:
        manifest = Manifest.from_json(storage.read_bytes(mpath), where=storage.display(mpath))
    except (CorruptCheckpointError, FileNotFoundError) as exc:
        return CheckpointInfo(name, -1, "corrupt", str(exc))
    problem = size_problem(manifest.files, sizes)
    if problem:
        return CheckpointInfo(name, manifest.step, "corrupt", problem, manifest)
    return CheckpointInfo(name, manifest.step, "committed", "", manifest)


def _part_records(storage: Storage, name: str, sizes: dict[str, int]) -> list[PartRecord]:
    records = []
    for rel in sizes:
        if rel.startswith(f"{META_DIR}/{name}/rank-") and rel.endswith(".json"):
            with contextlib.suppress(CorruptCheckpointError, FileNotFoundError):
                records.append(PartRecord.from_json(storage.read_bytes(rel), where=rel))
    return records


def part_files(storage: Storage, name: str) -> list[str]:
    """Data files that the part records of an uncommitted checkpoint name (to delete it)."""
    sizes = storage.sizes(f"{META_DIR}/{name}")
    return sorted({f.path for r in _part_records(storage, name, sizes) for f in r.files})


def size_problem(files: Iterable[FileEntry], sizes: dict[str, int]) -> str:
    """Why the listed sizes do not match ``files``, or ``""``."""
    for f in files:
        if f.path not in sizes:
            return f"file {f.path} is missing"
        if sizes[f.path] != f.size:
            return f"file {f.path} has {sizes[f.path]} bytes, the manifest says {f.size}"
    return ""


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _matches(path: str, entry: FileEntry) -> bool:
    return os.path.isfile(path) and os.path.getsize(path) == entry.size and file_crc32(path) == entry.crc32


def fetch(
    storage: Storage,
    cache_dir: str | None,
    manifest: Manifest,
    entries: list[FileEntry],
    *,
    max_transfers: int,
) -> tuple[dict[str, str], Literal["local", "cache", "remote"]]:
    """Local verified copies of ``entries`` (path -> local file) and where they came from.

    Raises:
        CorruptCheckpointError: a file does not match its manifest entry even after a fresh download.
    """
    if storage.is_local and cache_dir is None:
        paths = {e.path: storage.path(e.path) for e in entries}
        for e in entries:
            if not _matches(paths[e.path], e):
                raise _corrupt(storage, manifest, e)
        return paths, "local"
    assert cache_dir is not None
    paths = {e.path: os.path.join(cache_dir, *e.path.split("/")) for e in entries}
    cached = os.path.join(cache_dir, *manifest_path(manifest.name).split("/"))
    if _read(cached) == manifest.to_json() and all(_matches(paths[e.path], e) for e in entries):
        return paths, "cache"

    def download(e: FileEntry) -> None:
        storage.get_file(e.path, paths[e.path])
        if not _matches(paths[e.path], e):
            os.unlink(paths[e.path])
            raise _corrupt(storage, manifest, e)

    with ThreadPoolExecutor(max_workers=max_transfers, thread_name_prefix="air-download") as pool:
        for future in [pool.submit(download, e) for e in entries]:
            future.result()
    write_cached_manifest(cache_dir, manifest)
    return paths, "remote"


def write_cached_manifest(cache_dir: str, manifest: Manifest) -> None:
    """Record that the cache holds ``manifest``'s files (written after them, like the real commit)."""
    path = os.path.join(cache_dir, *manifest_path(manifest.name).split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"  # ranks of one node share the cache
    with open(tmp, "wb") as f:
        f.write(manifest.to_json())
    os.replace(tmp, path)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _corrupt(storage: Storage, manifest: Manifest, entry: FileEntry) -> CorruptCheckpointError:
    where = storage.display(entry.path)
    return CorruptCheckpointError(
        f"checkpoint {manifest.name!r} (step {manifest.step}): {where} does not match its manifest "
        "(size or CRC-32 differs); the file was changed or damaged after the commit.",
        path=where,
        reason="checksum mismatch",
    )


def verify(storage: Storage, info: CheckpointInfo, cache_dir: str | None, *, max_transfers: int) -> str:
    """Re-check every file of a committed checkpoint (sizes and checksums); return the problem or ``""``."""
    if info.manifest is None:
        return info.reason or "not committed"
    try:
        fetch(storage, cache_dir, info.manifest, list(info.manifest.files), max_transfers=max_transfers)
    except CorruptCheckpointError as exc:
        return str(exc)
    return ""
