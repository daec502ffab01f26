"""Where a save's files are written before they reach the root: the direct or staged destination.

The one place "direct or staged" is decided (``choose_destination``, once per checkpointer): a local
root without ``staging_dir`` is written in place (temp file, fsync, rename); anything else is serialized
into the local staging folder, uploaded ``max_transfers`` at a time, and kept there as the local cache
that later loads read first. A local root on the staging folder's filesystem gets each staged file by a
hard link (``Storage.put_file``): one write and one fsync, as in place, and the cache for free. Each
``Destination`` also reads back verified local copies. It never decides *when* (the writer) or whether
a save commits (commit).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, Protocol

from . import layout
from .catalog import read_catalog
from .checksum import file_crc32
from .commit import delete_checkpoint, keep_newest
from .config import CheckpointerConfig
from .errors import ConfigError, CorruptCheckpointError
from .leftovers import from_before_this_process
from .manifest import FileEntry, Manifest
from .storage import Put, Storage, fix_for, transfer_all
from .upload import Growing

logger = logging.getLogger(__name__)
Source = Literal["local", "cache", "remote"]

CACHE_KEEP = 2
"""Committed checkpoints a node's cache keeps at most, whatever the root keeps: the newest, which a restart
reads, and the one before, which it falls back to when the newest is damaged. Older ones are read from the
root. A cache that mirrored the root's retention filled the staging disk under a keep-all root
(Lightning's ``save_top_k=-1`` to S3) and kept, on every node but rank 0's, each checkpoint deleted from
the root by name (Lightning's ``save_top_k``): only rank 0 deletes, and other nodes hear of no delete."""


class Destination(Protocol):
    """How one save's files get to the root. Called on the writer thread, in this order, per save:

    1. ``temp_paths``: where the serializer writes each file (``fsync`` says whether it must sync);
       ``follow``: start uploading them as they are written (None: upload after ``place``);
    2. ``place``: move the finished temp files to where ``to_upload`` reads them (or to the root);
    3. ``to_upload``: local file per root path still to upload (empty: nothing to upload);
    4. after the commit, ``remember`` the manifest; after retention, ``trim`` the local cache.

    ``fetch`` (training thread, any time) returns verified local copies of committed files.
    """

    @property
    def cache_dir(self) -> str | None:
        """The local staging folder and cache; None when the root itself is written."""
        ...

    @property
    def spill_dir(self) -> str:
        """Where snapshots spill beyond the host budget."""
        ...

    @property
    def fsync(self) -> bool:
        """Whether the serializer must fsync what it writes (the written file is the durable one)."""
        ...

    def temp_paths(self, files: tuple[str, ...]) -> dict[str, str]: ...

    def follow(self, temps: dict[str, str]) -> Following | None: ...

    def place(self, temps: dict[str, str]) -> None: ...

    def to_upload(self, files: tuple[str, ...]) -> dict[str, str]: ...

    def upload(self, staged: dict[str, str]) -> list[Put]: ...

    def kept_locally(self, files: tuple[str, ...]) -> list[str]:
        """Local files a placed save keeps (removed again if the save fails)."""
        ...

    def remember(self, manifest: Manifest) -> None: ...

    def trim(self, keep_last: int) -> None: ...

    def forget(self, name: str) -> None:
        """Drop the local copy of checkpoint ``name``, deleted from the root (rank 0, after the delete)."""
        ...

    def disk_full_fix(self, exc: OSError) -> str: ...

    def fetch(
        self, manifest: Manifest, entries: list[FileEntry], *, max_transfers: int
    ) -> tuple[dict[str, str], Source]: ...


class Direct:
    """A local root written in place: temp file beside the final one, fsync, rename, folder fsync."""

    fsync = True

    def __init__(self, storage: Storage, spill_dir: str = "") -> None:
        assert storage.is_local, "a direct destination is a local root"
        self._storage = storage
        self.cache_dir: str | None = None
        self.spill_dir = spill_dir

    def temp_paths(self, files: tuple[str, ...]) -> dict[str, str]:
        return {rel: self._storage.local_temp(rel) for rel in files}

    def follow(self, temps: dict[str, str]) -> Following | None:
        return None

    def place(self, temps: dict[str, str]) -> None:
        for rel, tmp in temps.items():
            self._storage.place_local(tmp, rel)

    def to_upload(self, files: tuple[str, ...]) -> dict[str, str]:
        return {}

    def upload(self, staged: dict[str, str]) -> list[Put]:
        return []  # placed at the root already

    def kept_locally(self, files: tuple[str, ...]) -> list[str]:
        return []  # placed files are the root's: a failed save leaves a partial that retention removes

    def remember(self, manifest: Manifest) -> None:
        pass

    def trim(self, keep_last: int) -> None:
        pass

    def forget(self, name: str) -> None:
        pass  # the root's files were the only ones

    def disk_full_fix(self, exc: OSError) -> str:
        return fix_for(exc)

    def fetch(
        self, manifest: Manifest, entries: list[FileEntry], *, max_transfers: int
    ) -> tuple[dict[str, str], Source]:
        paths = {e.path: self._storage.path(e.path) for e in entries}
        for e in entries:
            if not matches(paths[e.path], e):
                raise _corrupt(self._storage, manifest, e)
        return paths, "local"


class Staged:
    """Serialize into a local staging folder, upload in parallel, keep the files as the local cache."""

    fsync = False  # the upload, not the staged copy, is what must be durable

    def __init__(
        self, storage: Storage, cache_dir: str, *, max_transfers: int = 1, staging_dir: str | None = None
    ) -> None:
        self._storage = storage
        self.cache_dir: str = cache_dir
        self.spill_dir = os.path.join(cache_dir, ".spill")
        self._max_transfers = max_transfers
        self._staging_arg = staging_dir

    def temp_paths(self, files: tuple[str, ...]) -> dict[str, str]:
        """Each file's temp path in the cache, with nothing there yet.

        A save killed while serializing leaves its temp, and the save of the same name after the resume
        (a step's default name, ``last.ckpt``) writes to the same path. An upload that follows the
        serializer (``follow``) would take that file's size and bytes for this save's, before the
        serializer truncates it: a corrupt object committed (a writer process opens the file late
        enough for that, every time). So a leftover is removed first."""
        local = self._local(files)
        temps = {}
        for rel, path in local.items():
            self._make_room(path)
            temps[rel] = f"{path}{layout.TEMP_MARK}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temps[rel])
        return temps

    def follow(self, temps: dict[str, str]) -> Following | None:
        """Upload the files as the serializer writes them, where the root allows (S3)."""
        if not self._storage.follows:
            return None
        finals = self._local(tuple(temps))
        return Following(self._storage, {rel: Growing(tmp, finals[rel]) for rel, tmp in temps.items()},
                         max_transfers=self._max_transfers)  # fmt: skip

    def place(self, temps: dict[str, str]) -> None:
        for rel, tmp in temps.items():
            os.replace(tmp, layout.local_path(self.cache_dir, rel))

    def to_upload(self, files: tuple[str, ...]) -> dict[str, str]:
        return self._local(files)

    def upload(self, staged: dict[str, str]) -> list[Put]:
        """Upload each staged file to its root path, ``max_transfers`` at a time (``Storage.put_file``:
        hard-linked to a local root on the staging folder's filesystem)."""
        return transfer_all(
            lambda item: self._storage.put_file(item[1], item[0]),
            staged.items(),
            max_transfers=self._max_transfers,
            name="air-upload",
        )

    def kept_locally(self, files: tuple[str, ...]) -> list[str]:
        return list(self._local(files).values())

    def remember(self, manifest: Manifest) -> None:
        """Record that the cache holds ``manifest``'s files (written after them, like the real commit)."""
        path = layout.local_path(self.cache_dir, layout.manifest_path(manifest.name))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"  # ranks of one node share the cache
        with open(tmp, "wb") as f:
            f.write(manifest.to_json())
        os.replace(tmp, path)

    def trim(self, keep_last: int) -> None:
        """Keep the newest ``keep_last`` (at most ``CACHE_KEEP``) checkpoints the cache holds a manifest of,
        and drop what killed saves left: files that no cached manifest names, written before this process
        (``leftovers.py``).

        A node's cache holds only its own ranks' files (and rank 0's after a load), so a cached
        checkpoint may look incomplete here; it is trimmed by its manifest all the same. A save killed
        after its files were placed here and before the cache recorded its manifest leaves them named by
        nothing: they go once no process that could still be writing them runs.
        """
        cached = self._cache()
        catalog = read_catalog(cached)
        keep_newest(cached, catalog, min(keep_last, CACHE_KEEP))
        held = [i for i in catalog.infos if i.manifest is not None]
        named = {path for i in held for path in (*catalog.files_of(i), layout.manifest_path(i.name))}
        others = (f"{layout.JOURNAL_DIR}/", f"{os.path.basename(self.spill_dir)}/")  # not checkpoint files
        for rel in catalog.sizes:
            if rel in named or rel.startswith(others):
                continue
            path = layout.local_path(self.cache_dir, rel)
            with contextlib.suppress(FileNotFoundError):
                if from_before_this_process(os.lstat(path)):
                    os.unlink(path)
                    logger.info("removed %s from the cache: a killed save's, named by no manifest", path)

    def forget(self, name: str) -> None:
        """Drop the cache's copy of ``name`` with the root's: deletes asked for by name (Lightning's
        ``save_top_k``, with retention by count off) would otherwise free nothing on this disk, the staged
        files being links to the root's blocks or copies of them."""
        cached = self._cache()
        catalog = read_catalog(cached)
        for info in catalog.infos:
            if info.name == name and info.manifest is not None:
                delete_checkpoint(cached, info, catalog, cached=True)

    def _cache(self) -> Storage:
        return Storage(self.cache_dir, storage_options={}, retries=0, retry_backoff_seconds=0.0)

    def disk_full_fix(self, exc: OSError) -> str:
        return (
            f"The staging disk is full: free space under staging_dir ({self._staging_arg or self.cache_dir}),"
            f" or point staging_dir at a larger disk (the local cache keeps a copy of the newest {CACHE_KEEP}"
            " checkpoints)."
        )

    def fetch(
        self, manifest: Manifest, entries: list[FileEntry], *, max_transfers: int
    ) -> tuple[dict[str, str], Source]:
        """The cache's copies when its manifest is byte-identical, the CRCs match and the root's files
        were not written since the commit (``_unchanged_at_root``), else a download, checked."""
        paths = self._local(tuple(e.path for e in entries))
        cached = _read(layout.local_path(self.cache_dir, layout.manifest_path(manifest.name)))
        if (
            cached == manifest.to_json()
            and all(matches(paths[e.path], e) for e in entries)
            and self._unchanged_at_root(manifest, entries)
        ):
            return paths, "cache"

        for path in paths.values():
            self._make_room(path)
        self._storage.get_files(paths, max_transfers=max_transfers)
        for e in entries:
            if not matches(paths[e.path], e):
                os.unlink(paths[e.path])
                raise _corrupt(self._storage, manifest, e)
        self.remember(manifest)
        return paths, "remote"

    def _unchanged_at_root(self, manifest: Manifest, entries: list[FileEntry]) -> bool:
        """Whether no file of ``entries`` at the root was written after the commit's manifest. A file
        rewritten in place by another writer (a stock save to the same path) at the same size still lists
        as committed, and the cache would serve the commit's bytes for it; read from the root instead, its
        CRC tells. A root whose filesystem gives no times is taken as unchanged."""
        try:
            committed_at = self._storage.modified(layout.manifest_path(manifest.name))
            if committed_at is None:
                return True
            for e in entries:
                written = self._storage.modified(e.path)
                if written is not None and written > committed_at:
                    return False
            return True
        except FileNotFoundError:
            return False

    def _local(self, files: tuple[str, ...]) -> dict[str, str]:
        return {rel: layout.local_path(self.cache_dir, rel) for rel in files}

    def _make_room(self, path: str) -> None:
        """Let a file be written at ``path`` in the cache: a cached copy of another checkpoint in the way
        is dropped (a folder of this file's name, or a file where its folder goes: a sharded save and a
        full one of the same name, ``last.ckpt``). It is only a cache: that checkpoint is fetched again
        if it is ever read."""
        parent = os.path.dirname(path)
        below = os.path.relpath(parent, self.cache_dir).split(os.sep)
        for i in range(1, len(below) + 1):
            ancestor = os.path.join(self.cache_dir, *below[:i])
            if os.path.isfile(ancestor):
                with contextlib.suppress(FileNotFoundError):  # another rank of this node was first
                    os.unlink(ancestor)
                break
        os.makedirs(parent, exist_ok=True)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)  # what stays makes the write fail, saying where


class Following:
    """The uploads of one save's files that started while the serializer writes them.

    ``finish`` (every file written) or ``abandon`` (the save failed), then ``wait`` for the puts. The
    files upload ``max_transfers`` at a time, in the order the serializer writes them.
    """

    def __init__(self, storage: Storage, files: dict[str, Growing], *, max_transfers: int) -> None:
        self._files = files
        workers = max(1, min(max_transfers, len(files)))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="air-upload")
        self._futures = [
            self._pool.submit(storage.put_file, growing.final, rel, growing) for rel, growing in files.items()
        ]
        self._pool.shutdown(wait=False)

    def finish(self, sizes: dict[str, int]) -> None:
        for rel, growing in self._files.items():
            growing.finish(sizes[rel])

    def abandon(self) -> None:
        """Stop every upload (each aborts what it sent) and wait for them."""
        for growing in self._files.values():
            growing.abandon()
        for future in self._futures:
            future.exception()

    def wait(self) -> list[Put]:
        """Every file's put, once all are at the root; the first failure is raised (the rest abandoned)."""
        try:
            return [future.result() for future in self._futures]
        except BaseException:
            self.abandon()
            raise


def choose_destination(config: CheckpointerConfig, storage: Storage) -> Destination:
    """Pick the destination once, and prove its local folder writable (``ConfigError`` if not)."""
    key = hashlib.sha1(storage.url.encode()).hexdigest()[:16]
    dest: Direct | Staged
    if config.staging_dir is None and storage.is_local:
        dest = Direct(storage, os.path.join(tempfile.gettempdir(), "air-spill", key))
    else:
        staging = _local_dir(config.staging_dir) if config.staging_dir else None
        if staging is None:
            staging = os.path.join(tempfile.gettempdir(), "air-staging")
            logger.info(
                "no staging_dir given: staging in %s (pass staging_dir= to use a local NVMe disk)", staging
            )
        cache = os.path.join(staging, key)
        dest = Staged(storage, cache, max_transfers=config.max_transfers, staging_dir=config.staging_dir)
    _check_local_dir(dest.cache_dir or dest.spill_dir, "staging_dir", config.staging_dir)
    return dest


def open_destination(storage: Storage, cache_dir: str | None) -> Destination:
    """The destination a tool reads through: a local root in place when ``cache_dir`` is None."""
    return Direct(storage) if cache_dir is None else Staged(storage, cache_dir)


def matches(path: str, entry: FileEntry, *, remember: bool = False) -> bool:
    """Whether the file at ``path`` has ``entry``'s size and CRC-32.

    With ``remember``, the result serves the next check of the same file once, if the file is unchanged
    (same inode, size and modification time): a resume that checked its parts (the local tier's
    ``recover``) does not read them a second time when the load right after checks them. Any later check
    reads the file again.
    """
    try:
        st = os.stat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
        return False
    crc = _REMEMBERED.pop(_identity(st), None)
    if crc is None:
        crc = file_crc32(path)
    if remember:
        _remember(st, crc)
    return crc == entry.crc32


def remember(path: str, crc32: int) -> None:
    """Serve the next ``matches`` of the file at ``path``, if unchanged, with ``crc32``: the CRC-32 of its
    bytes as they were computed while it was written (a copy received and checked on arrival)."""
    _remember(os.stat(path), crc32)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _remember(st: os.stat_result, crc: int) -> None:
    if len(_REMEMBERED) > _REMEMBER_AT_MOST:  # checks never followed by a load
        _REMEMBERED.clear()
    _REMEMBERED[_identity(st)] = crc


_REMEMBERED: dict[tuple[int, int, int, int], int] = {}
_REMEMBER_AT_MOST = 1 << 12


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


def _local_dir(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def _check_local_dir(path: str, arg: str, value: str | None) -> None:
    """Create ``path`` and prove it writable, so a bad staging folder fails before training."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f"{layout.PROBE_PREFIX}{uuid.uuid4().hex[:8]}")
        with open(probe, "wb") as f:
            f.write(b"probe")
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"AsyncCheckpointer({arg}={value!r}): cannot write to {path} ({exc.strerror or exc}); pass a "
            "writable folder on a local disk."
        ) from exc
