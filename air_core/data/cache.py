"""Remote training files on local disk before the loader asks for them.

``FileCache`` keeps local copies of a remote root's files in ``cache_dir`` within ``budget_bytes``,
downloading ``max_transfers`` at a time in the training process; ``RemoteFiles`` is a map-style dataset
over them that a ``TrackedLoader`` (the adapters' loaders) tells which samples the loader reads next, so
the cache fetches them ahead in that order, after a resume too. Per-file state and counters are
shared-memory tensors, so loader workers' reads count. It keeps no position (the ``TrackedLoader``'s
is in the checkpoint). Key decision, not fsspec's ``filecache``: that copies on open, never ahead, has no
byte budget and a per-process index. ``docs/data-cache.md`` has the details.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

from ..errors import ConfigError, StorageError
from ..storage import TEMP_TAG, Storage

logger = logging.getLogger(__name__)
_ROWS = 65  # the training process and up to 64 loader workers
_HITS, _MISSES, _WAIT, _BYTES = range(4)
_ABSENT, _WANTED, _READ = 0, 1, 2


class FileCache:
    """Local copies of files under ``root``, downloaded ahead of use, within ``budget_bytes``.

    Args:
        root: the remote folder (any fsspec URL or path).
        cache_dir: a local (NVMe) folder; ranks of one node may share it.
        budget_bytes: most bytes of cached files on disk (prefetched and not yet evicted).
        max_transfers: parallel downloads.
        storage_options: passed to fsspec untouched.
        retries, retry_backoff_seconds: for transient download errors.

    Raises:
        ConfigError: bad settings, or a file larger than the budget.
        StorageError: the root cannot be listed.
    """

    def __init__(
        self,
        root: str,
        *,
        cache_dir: str,
        budget_bytes: int,
        max_transfers: int = 4,
        storage_options: dict[str, Any] | None = None,
        retries: int = 5,
        retry_backoff_seconds: float = 0.2,
    ) -> None:
        for arg, value, minimum in (("budget_bytes", budget_bytes, 1), ("max_transfers", max_transfers, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"FileCache({arg}={value!r}): {arg} must be an integer >= {minimum}.")
        if not isinstance(cache_dir, str) or "://" in cache_dir:
            raise ConfigError(
                f"FileCache(cache_dir={cache_dir!r}): pass a local folder path, e.g. '/nvme/data'."
            )
        self._open = (root, storage_options or {}, retries, retry_backoff_seconds)
        self._storage = self._connect()
        key = hashlib.sha1(self._storage.url.encode()).hexdigest()[:16]
        self.cache_dir = os.path.join(cache_dir, key)
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"FileCache(cache_dir={cache_dir!r}): cannot create it ({exc}).") from exc
        self.sizes = self._storage.sizes()
        """Every file under the root and its size (one listing, at construction)."""
        largest = max(self.sizes.values(), default=0)
        if largest > budget_bytes:
            raise ConfigError(
                f"FileCache(budget_bytes={budget_bytes}): the largest file under {self._storage.display()} "
                f"has {largest} bytes; the budget must hold at least one file (and a few for prefetch)."
            )
        self.budget_bytes = budget_bytes
        self.max_transfers = max_transfers
        self._counts = torch.zeros(_ROWS, 4, dtype=torch.float64).share_memory_()
        self._names = sorted(self.sizes)
        self._ids = {rel: i for i, rel in enumerate(self._names)}
        self._size_of = torch.tensor([self.sizes[rel] for rel in self._names], dtype=torch.float64)
        self._state = torch.zeros(len(self._names), dtype=torch.int8).share_memory_()
        """Per file, shared by the loader workers: ABSENT, WANTED (fetched or being fetched, not read
        since) or READ (evictable)."""
        self._read_at = torch.zeros(len(self._names), dtype=torch.float64).share_memory_()
        """Per file: when it was last read (least recently read is evicted first)."""
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        for rel in self._scan_disk():  # a warm cache from an earlier run: counted, evictable
            self._state[self._ids[rel]] = _READ
            self._read_at[self._ids[rel]] = os.path.getmtime(self.local_path(rel))
        self._make_room(0)

    # -- reads (any process) ---------------------------------------------------------------------
    def local_path(self, rel: str) -> str:
        return os.path.join(self.cache_dir, *rel.split("/"))

    def path(self, rel: str) -> str:
        """A complete local copy of ``rel``: from the cache, after an in-flight prefetch, or downloaded.

        The file is not evicted until ``done(rel)``: call it once the copy has been read.

        Raises:
            StorageError: the download failed after its retries (names the file and the fix).
        """
        local, i = self.local_path(rel), self._ids[rel]
        row = self._row()
        self._state[i] = _WANTED
        if os.path.exists(local):
            self._counts[row, _HITS] += 1
            return local
        started = time.monotonic()
        marker = f"{local}.inflight"
        while not os.path.exists(local):
            gone = os.getpid() != self._owner and os.getppid() != self._owner  # the prefetching process
            if _claim(marker) or gone or time.monotonic() - started > 120:
                try:  # the readers outran the prefetch: make room if read files allow, and fetch it here
                    if os.path.exists(local):  # the prefetch finished between the check and the claim
                        self._counts[row, _HITS] += 1
                        break
                    self._make_room(self.sizes[rel])
                    self._download(rel, local, row)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(marker)
                self._counts[row, _MISSES] += 1
                break
            time.sleep(0.002)  # a prefetch (or another reader) is fetching it
        else:
            self._counts[row, _HITS] += 1  # late: the prefetch was on its way
        self._counts[row, _WAIT] += time.monotonic() - started
        return local

    def done(self, rel: str) -> None:
        """``rel`` has been read: it may be evicted (least recently read first) when room is needed."""
        i = self._ids[rel]
        self._state[i], self._read_at[i] = _READ, time.time()

    def stats(self) -> dict[str, float]:
        """Cumulative counts over the training process and its loader workers."""
        hits, misses, wait, nbytes = self._counts.sum(dim=0).tolist()
        return {
            "data_cache_hits": hits,
            "data_cache_misses": misses,
            "data_cache_wait_seconds": wait,
            "data_cache_bytes_downloaded": nbytes,
        }

    # -- prefetch (the training process) -----------------------------------------------------------
    def prefetch(self, rels: Sequence[str]) -> None:
        """Download ``rels`` in the background, in order, as far as the budget allows."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_transfers, thread_name_prefix="air-prefetch")
            for rel in rels:
                if rel not in self._ids:
                    raise ConfigError(f"FileCache: {rel!r} is not under {self._storage.display()}.")
                i, local = self._ids[rel], self.local_path(rel)
                if self._state[i] == _WANTED:
                    continue
                if self._state[i] == _READ and os.path.exists(local):
                    self._state[i] = _WANTED  # read before, wanted again: not evictable until read
                    continue
                if not self._make_room(self.sizes[rel]):
                    break  # the budget is full of files not read yet: the next call tries again
                self._state[i] = _WANTED
                if not os.path.exists(local) and _claim(f"{local}.inflight"):  # else: there, or a rank has it
                    self._pool.submit(self._prefetch_one, rel, local)

    def close(self) -> None:
        """Finish the downloads already scheduled (a prefetch depth or so) and stop; the files stay."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _scan_disk(self) -> list[str]:
        """Complete files already in the cache; marks and temp files a killed run left are removed
        (a reader would wait on a stale mark). One walk of the folder."""
        found = []
        for folder, _, names in os.walk(self.cache_dir):
            for name in names:
                path = os.path.join(folder, name)
                if name.endswith(".inflight") or TEMP_TAG in name:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    continue
                rel = os.path.relpath(path, self.cache_dir).replace(os.sep, "/")
                if self.sizes.get(rel) == os.path.getsize(path):
                    found.append(rel)
        return found

    def _make_room(self, size: int) -> bool:
        """Evict files already read, least recently read first, until ``size`` more bytes fit.

        Any process may call it (vectorized over the shared table: cheap with a million files).
        """
        held = float(self._size_of[self._state != _ABSENT].sum())
        if held + size <= self.budget_bytes:
            return True
        read = torch.nonzero(self._state == _READ).flatten()
        for i in read[torch.argsort(self._read_at[read])].tolist():
            if held + size <= self.budget_bytes:
                break
            self._state[i] = _ABSENT
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.local_path(self._names[i]))
            held -= self.sizes[self._names[i]]
        return held + size <= self.budget_bytes

    def _prefetch_one(self, rel: str, local: str) -> None:
        marker = f"{local}.inflight"
        try:
            if not os.path.exists(local):
                self._download(rel, local, 0)
        except Exception as exc:  # the reader downloads it itself, and raises if that fails too
            logger.warning("prefetch of %s failed: %s", self._storage.display(rel), exc)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(marker)

    def _connect(self) -> Storage:
        root, options, retries, backoff = self._open
        self._storage_pid = os.getpid()
        return Storage(root, storage_options=options, retries=retries, retry_backoff_seconds=backoff)

    def _download(self, rel: str, local: str, row: int) -> None:
        if os.getpid() != self._storage_pid:  # a forked loader worker: fsspec clients are not fork-safe
            self._storage = self._connect()
        # Counted before the file appears (taken back if the download fails): a reader that finds it and
        # the metrics published after that read see its bytes. Prefetch threads share row 0.
        with self._count_lock:
            self._counts[row, _BYTES] += self.sizes[rel]
        try:
            self._storage.get_file(rel, local, size=self.sizes[rel])  # listed at the start: no request
        except BaseException as exc:
            with self._count_lock:
                self._counts[row, _BYTES] -= self.sizes[rel]
            if isinstance(exc, FileNotFoundError):
                raise StorageError(
                    f"FileCache: {self._storage.display(rel)} is not there ({exc}); was it removed after the "
                    "run started?"
                ) from exc
            raise

    @staticmethod
    def _row() -> int:
        info = get_worker_info()
        return 0 if info is None else 1 + info.id % (_ROWS - 1)

    def __getstate__(self) -> dict[str, Any]:  # a copy for a loader worker: no pool, no lock
        state = self.__dict__.copy()
        state.update(_pool=None, _lock=None, _count_lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._count_lock = threading.Lock(), threading.Lock()


def _claim(marker: str) -> bool:
    """Create ``marker`` unless it exists (the ``.inflight`` mark that readers wait on)."""
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class RemoteFiles(Dataset):
    """Item ``i`` is ``read(local path of files[i])``, the file served by ``cache``.

    Given to a ``DataLoader`` that an adapter (or a ``TrackedLoader``) tracks, its files are fetched
    ahead of the loader's reads, in the order the loader takes them: ``prefetch_depth`` samples beyond
    the ones it has taken (its workers' read-ahead included), from the resume point after a resume. The
    session's metrics get the cache's counters.

    Raises:
        ConfigError: a file that is not under the cache's root, or a bad ``prefetch_depth``.
    """

    def __init__(
        self, cache: FileCache, files: Sequence[str], read: Callable[[str], Any], *, prefetch_depth: int = 16
    ) -> None:
        missing = [f for f in files if f not in cache.sizes]
        if missing:
            raise ConfigError(f"RemoteFiles(files=...): not under the cache's root: {missing[:5]}")
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 1:
            raise ConfigError(f"RemoteFiles(prefetch_depth={prefetch_depth!r}): must be an integer >= 1.")
        self.cache = cache
        self.files = list(files)
        self.read = read
        self.prefetch_depth = prefetch_depth

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> Any:
        rel = self.files[i]
        for attempt in range(3):
            try:
                item = self.read(self.cache.path(rel))
                break
            except FileNotFoundError:  # evicted between the check and the open (a race): fetch it again
                if attempt == 2:
                    raise
        self.cache.done(rel)
        return item

    def prefetch(self, indices: list[int]) -> None:
        """The loader reads these items next, in this order: fetch their files (the training process)."""
        self.cache.prefetch([self.files[i] for i in indices])

    @property
    def counters(self) -> Callable[[], dict[str, float]]:
        """The cache's ``stats`` (one source per cache, however many datasets share it)."""
        return self.cache.stats
