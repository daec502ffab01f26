"""The destination: the only module that imports fsspec (with ``download.py`` and ``upload.py``, its
range reader and part writer).

A root URL becomes a filesystem of our own (outside fsspec's instance cache) with a few verbs over
root-relative paths. A file appears at its final name only when complete: on POSIX by temp file,
fsync, rename and folder fsync; on an object store by one completed PUT, never by rename. Transient
errors are retried with backoff and jitter; anything else is a ``StorageError`` naming the path and
the fix. ``transfer_all`` bounds parallel transfers; downloads go by byte ranges (``download.py``).
It knows nothing of checkpoints or layouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import random
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, NamedTuple, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from . import download, upload
from .directio import copy_file
from .errors import ConfigError, StorageError
from .layout import META_DIR, RESERVED_DIRS, TEMP_MARK, probe_path

logger = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")

_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "abfs": "azure", "az": "azure", "adl": "azure"}
TEMP_TAG = f"{TEMP_MARK}-"
"""In the name of every temp file this module writes (a killed process may leave one behind)."""
_TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.EIO, errno.EREMOTEIO}
_CANNOT_LINK = {errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS}
"""``link`` refused by the filesystem (another mount of the same disk, no hard links): copy instead."""
_UNANSWERED = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ServerDisconnectedError",
}
"""botocore/aiohttp errors of an endpoint that refused the connection or never answered."""
_TIMEOUTS = (TimeoutError, asyncio.TimeoutError)
"""Before Python 3.11 asyncio's timeout is not the builtin one, and fsspec's ``FSTimeoutError`` (a
request that got no answer) derives from asyncio's."""
PROBE_TIMEOUT_SECONDS = 5.0
"""How long each request of a probe (``Storage.probe``) may take, its backend's retries included."""
PROBE_ATTEMPTS = 3
"""botocore's attempts per probe request (its backoff before the third: up to 2 s, within the bound)."""


def redact(url: str) -> str:
    """Drop user info and query strings (tokens) from a URL before it is logged or recorded."""
    url = re.sub(r"^([a-zA-Z][\w+.-]*://)[^/@]*@", r"\1", url)
    return url.split("?", 1)[0]


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying: a timeout, a dropped connection, throttling or a 5xx."""
    if isinstance(exc, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError)):
        return False
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    # A timeout or dropped connection (is_unanswered), or aiohttp/botocore errors that fsspec backends let
    # through untranslated.
    return type(exc).__name__ == "ClientPayloadError" or is_unanswered(exc)


def is_unanswered(exc: BaseException | None) -> bool:
    """Whether ``exc`` says the endpoint refused the connection or did not answer in time."""
    return isinstance(exc, (*_TIMEOUTS, ConnectionError)) or type(exc).__name__ in _UNANSWERED


def location(url: str) -> str:
    """One spelling per location, fsspec's: a local path absolute with its links resolved (``file://``,
    ``~`` and a relative path included), any other URL as its backend strips it, with its scheme and no
    trailing slash. For telling whether two paths a framework gave name the same folder; no I/O."""
    protocol, _ = fsspec.core.split_protocol(url)
    if protocol in (None, "file", "local"):
        return os.path.realpath(os.path.expanduser(fsspec.core.strip_protocol(url)))
    try:
        stripped = fsspec.core.strip_protocol(url)
    except (ImportError, ValueError):  # no backend: the Storage that opens it says so
        return url.rstrip("/")
    return f"{protocol}://{str(stripped).rstrip('/')}"


def remove_emptied(folder: str, *, below: str, keep: frozenset[str] = frozenset()) -> None:
    """Remove the local ``folder`` and each folder above it while it is empty, up to ``below`` (never
    removed itself) and never one of ``keep``: what a delete or a launch that kept nothing leaves."""
    below = below.rstrip(os.sep)
    while folder.startswith(below + os.sep) and folder not in keep:
        try:
            os.rmdir(folder)
        except OSError:  # not empty (or gone): something is kept there
            return
        folder = os.path.dirname(folder)


class Storage:
    """Files under one root URL, addressed by relative POSIX paths.

    Thread-safe for distinct paths; the writer orders operations on the same path. Each instance owns
    its fsspec filesystem (``skip_instance_cache``) and re-lists before any recovery decision.
    """

    def __init__(
        self,
        root: str,
        *,
        storage_options: dict[str, Any],
        retries: int,
        retry_backoff_seconds: float,
    ) -> None:
        self.url = redact(root)
        self._retries = retries
        self._backoff = retry_backoff_seconds
        try:
            options = _plain_copy(storage_options)
            self.fs, base = fsspec.core.url_to_fs(root, skip_instance_cache=True, **options)
        except ImportError as exc:
            scheme = root.split("://", 1)[0]
            extra = _EXTRAS.get(scheme)
            fix = (
                f"pip install 'air-plugins[{extra}]'" if extra else f"install the fsspec backend for {scheme}"
            )
            raise ConfigError(
                f"AsyncCheckpointer(root={self.url!r}): {scheme}:// URLs need a package that is not "
                f"installed ({exc}). Install it: {fix}"
            ) from exc
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"AsyncCheckpointer(root={self.url!r}): fsspec cannot open this URL ({exc}). Use a local "
                "path or a URL whose scheme fsspec knows (s3://, gs://, abfs://, file://, memory://), and "
                "check storage_options."
            ) from exc
        upload.answered_puts(self.fs)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.base = os.path.abspath(base) if self.is_local else base.rstrip("/")
        self._bound: dict[str, float] = {}
        """``{"timeout": seconds}`` on a probe of an async backend: fsspec cancels a longer request."""

    @classmethod
    def probe(cls, root: str, *, storage_options: dict[str, Any], beside: Storage | None = None) -> Storage:
        """A ``Storage`` of ``root`` for a check before training, which fails in seconds where the
        endpoint refuses or never answers: no retries of ours, each request cut at
        ``PROBE_TIMEOUT_SECONDS`` (fsspec's ``timeout``, on an async backend such as s3fs), and s3://
        with ``PROBE_ATTEMPTS`` of botocore's.

        Otherwise that costs botocore's retries times ours, a minute; and an S3 PUT to an endpoint that
        accepts the connection but never answers waits forever (aiohttp starts its read timeout only
        after the ``100-continue``). The Storage that transfers checkpoints keeps the patient defaults
        (a hiccup during training must not fail a save); ``storage_options`` stay the user's own.
        ``beside``: that Storage (of ``root``, the same options), whose botocore session the probe
        shares: a second session loads the service models again, 15 MiB for the life of the process.
        """
        options = _probe_options(root, storage_options)
        if beside is not None and options is not storage_options:  # s3fs
            beside.fs.connect()  # makes its session (no request)
            options["session"] = beside.fs.session
        storage = cls(root, storage_options=options, retries=0, retry_backoff_seconds=0)
        if isinstance(storage.fs, AsyncFileSystem):
            storage._bound = {"timeout": PROBE_TIMEOUT_SECONDS}
        return storage

    # -- addressing --------------------------------------------------------------------------
    def path(self, rel: str) -> str:
        """The backend path of ``rel``."""
        return f"{self.base}/{rel}" if rel else self.base

    def display(self, rel: str = "") -> str:
        """``rel`` as a URL safe to show a user."""
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    # -- retries -----------------------------------------------------------------------------
    def call(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transient errors; raise ``StorageError`` naming ``what`` and the path."""
        for attempt in range(self._retries + 1):
            try:
                return fn()
            except Exception as exc:
                if not is_transient(exc) or attempt == self._retries:
                    if isinstance(exc, FileNotFoundError):
                        raise
                    raise StorageError(
                        f"{what} {self.display(rel)} failed after {attempt + 1} attempt(s): "
                        f"{_describe(exc)}. {fix_for(exc)}"
                    ) from exc
                delay = self._backoff * (2**attempt) * (0.5 + random.random())
                logger.warning(
                    "%s %s: transient %s (%s); retry %d/%d in %.2fs",
                    what,
                    self.display(rel),
                    type(exc).__name__,
                    exc,
                    attempt + 1,
                    self._retries,
                    delay,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    # -- writes ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def open_atomic(self, rel: str) -> Iterator[IO[bytes]]:
        """Yield a file that appears at ``rel`` only if the block completes (local roots only)."""
        assert self.is_local, "open_atomic is for local destinations"
        final = self.path(rel)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = _temp_name(final)
        try:
            with open(tmp, "wb", buffering=0) as f:
                yield f
                os.fsync(f.fileno())
            _rename_durably(tmp, final)
        finally:
            _discard(tmp)

    def local_temp(self, rel: str) -> str:
        """A temp path beside ``rel``'s final place (local roots), for ``place_local``."""
        assert self.is_local, "local_temp is for local destinations"
        final = self.path(rel)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        return _temp_name(final)

    def place_local(self, tmp: str, rel: str) -> None:
        """Rename an fsynced temp file to ``rel`` and fsync the folder (local roots)."""
        self.call("place", rel, lambda: _rename_durably(tmp, self.path(rel)))

    def put_file(self, local_path: str, rel: str, growing: upload.Growing | None = None) -> Put:
        """Upload ``local_path`` to ``rel`` (complete or not at all); say how, and the size found there.

        To a local root on the file's own filesystem the file is hard-linked, not copied: the staged
        copy and the root's share their blocks, so a staged save costs what a direct one does (one
        write, one fsync). Across devices (or where the filesystem refuses links) it is copied.
        ``growing``: the file is still being written (object stores that ``follows``; its parts go
        as they are written).
        """

        def put() -> Put:
            linked = False
            if self.is_local:
                linked = _link_durably(local_path, self.local_temp(rel), self.path(rel))
                if not linked:  # around the page cache, 2 MiB of buffers per transfer (directio.py)
                    with self.open_atomic(rel) as dst:
                        copy_file(local_path, dst.name)
            else:
                upload.put_file(self.fs, local_path, self.path(rel), growing)
            size = growing.finished() if growing is not None else os.path.getsize(local_path)
            found = int(self.fs.info(self.path(rel))["size"])
            if found != size:
                raise OSError(errno.EIO, f"uploaded {size} bytes but the destination holds {found}")
            return Put(found, linked)

        return self.call("upload to", rel, put)

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a small file atomically (records and manifests)."""

        def write() -> None:
            if self.is_local:
                with self.open_atomic(rel) as f:
                    f.write(data)
            else:
                self.fs.pipe_file(self.path(rel), data, **self._bound)

        self.call("write", rel, write)

    # -- reads -------------------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        """Read a whole (small) file; ``FileNotFoundError`` if absent."""
        return self.call("read", rel, lambda: self.fs.cat_file(self.path(rel), **self._bound))

    def read_if_present(self, rel: str) -> bytes | None:
        """Read a whole (small) file, or None if absent: one GET, where ``exists`` may list a prefix."""
        try:
            return self.read_bytes(rel)
        except FileNotFoundError:
            return None

    def get_file(self, rel: str, local_path: str, *, size: int | None = None) -> None:
        """Download ``rel`` to ``local_path``, which appears only when complete (``size``: ``get_files``)."""
        self.get_files({rel: local_path}, max_transfers=1, sizes=None if size is None else {rel: size})

    def get_files(
        self, files: dict[str, str], *, max_transfers: int, sizes: dict[str, int] | None = None
    ) -> None:
        """Download each ``rel`` to its local path, which appears only when complete.

        The files are split into byte ranges (``download.py``) streamed into preallocated temp files,
        ``max_transfers`` ranges at a time over all the files; a failed range is retried alone.
        ``sizes``: the files' sizes if a listing gave them (no request to ask); otherwise each is asked,
        so that a file changed since its commit downloads whole and fails its check, not the download.
        """
        ranges: list[tuple[str, int, int, int]] = []  # (rel, temp file descriptor, start, end)
        with contextlib.ExitStack() as cleanup:  # last in, first out: close each temp, then drop it
            temps = {}
            for rel, local in files.items():
                size = sizes[rel] if sizes is not None else self.size(rel)
                os.makedirs(os.path.dirname(local), exist_ok=True)
                temps[local] = tmp = _temp_name(local)
                cleanup.callback(_discard, tmp)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                cleanup.callback(os.close, fd)
                os.ftruncate(fd, size)
                ranges += [(rel, fd, start, end) for start, end in download.parts(size)]
            progress = download.Progress(sum(end - start for *_, start, end in ranges), self.display())

            def get(item: tuple[str, int, int, int]) -> None:
                rel, fd, start, end = item
                path = self.path(rel)
                self.call("download", rel, lambda: download.read_range(self.fs, path, start, end, fd))
                progress.add(end - start)

            transfer_all(get, ranges, max_transfers=max_transfers, name="air-download")
            for local, tmp in temps.items():
                os.replace(tmp, local)
        progress.finish(len(files), len(ranges))

    def sizes(self, rel_dir: str = "") -> dict[str, int]:
        """Every file below ``rel_dir`` with its size, keyed by path relative to the root (fresh listing)."""
        self.fs.invalidate_cache()
        top = self.path(rel_dir)

        def find() -> dict[str, Any]:
            try:
                return self.fs.find(top, detail=True)
            except FileNotFoundError:
                return {}

        found = self.call("list", rel_dir, find)
        prefix = self.base.rstrip("/") + "/"
        out = {}
        for path, info in found.items():
            path = path if not self.is_local else os.path.abspath(path)
            if path.startswith(prefix) and info.get("type", "file") == "file":
                out[path[len(prefix) :]] = int(info["size"])
        return out

    def size(self, rel: str) -> int:
        """The size of the file at ``rel``; ``FileNotFoundError`` if absent."""
        return self.call("check", rel, lambda: int(self.fs.info(self.path(rel))["size"]))

    def modified(self, rel: str) -> float | None:
        """When the file at ``rel`` was last written (seconds since the epoch), or None where the filesystem
        does not say; ``FileNotFoundError`` if absent."""

        def get() -> float | None:
            try:
                return float(self.fs.modified(self.path(rel)).timestamp())
            except (NotImplementedError, IsADirectoryError):
                return None

        return self.call("check", rel, get)

    def exists(self, rel: str) -> bool:
        return self.call("check", rel, lambda: self.fs.exists(self.path(rel)))

    # -- deletes -----------------------------------------------------------------------------
    def remove(self, rel: str) -> None:
        """Remove a file or a folder tree; a missing one is not an error."""

        def rm() -> None:
            try:
                self.fs.rm(self.path(rel), recursive=True, **self._bound)
            except FileNotFoundError:
                pass

        self.call("delete", rel, rm)
        if self.is_local:
            self._prune(rel)

    def move_local(self, rel: str, to: str) -> None:
        """Rename the file ``rel`` to the absolute path ``to`` on the same filesystem (local roots),
        replacing what is there; the folders it leaves empty go as after ``remove``."""
        assert self.is_local, "move_local is for local roots"
        self.call("move", rel, lambda: os.replace(self.path(rel), to))
        self._prune(rel)

    def _prune(self, rel: str) -> None:
        """Keep the tree tidy: drop the folders above ``rel`` that a delete left empty, but never the
        shared record folders (another rank may be about to write into them)."""
        shared = frozenset(os.path.join(self.base, folder) for folder in RESERVED_DIRS)
        remove_emptied(os.path.dirname(self.path(rel)), below=self.base, keep=shared)

    def remove_if_empty(self, made: str) -> None:
        """A local root holding nothing but empty record folders goes, with the folders above it up to
        ``made`` (the outermost one its job made) that it leaves empty; an object store has no folders."""
        if not self.is_local:
            return
        for folder in RESERVED_DIRS:
            remove_emptied(os.path.join(self.base, folder), below=self.base)
        remove_emptied(self.base, below=os.path.dirname(made.rstrip(os.sep)))

    @property
    def follows(self) -> bool:
        """Whether an upload can start while its file is still being written (``upload.follows``)."""
        return not self.is_local and upload.follows(self.fs)

    def missing(self) -> str | None:
        """What the filesystem can tell is not there, for a reader that must not take a typo for an empty
        root: ``"no such folder: PATH"`` or ``"PATH is a file, not a folder"`` (a local root), ``"no such
        bucket: URL"`` (an object store's bucket or container, one HEAD), else ``None``. A prefix with
        nothing under it is an empty root to an object store, so it is never missing; nor is a bucket the
        backend cannot answer for (the listing that follows reports that error)."""
        if self.is_local:
            if os.path.isdir(self.base):
                return None
            if os.path.exists(self.base):
                return f"{self.base} is a file, not a folder"
            return f"no such folder: {self.base}"
        scheme = self.url.split("://", 1)[0]
        if scheme not in _EXTRAS:
            return None
        bucket = self.base.split("/", 1)[0]
        try:
            self.call("check", "", lambda: self.fs.info(bucket))
        except FileNotFoundError:
            return f"no such bucket: {scheme}://{bucket}"
        except StorageError:  # denied or unanswered: not known missing
            pass
        return None

    def check_writable(self) -> None:
        """Write and delete a probe under the root, so a bad URL, endpoint or credential fails before
        training (on a ``Storage.probe``, in seconds)."""
        rel = probe_path(uuid.uuid4().hex[:12])
        try:
            self.write_bytes(rel, b"probe")
        except FileNotFoundError as exc:  # object stores: the bucket (container) is not there
            fix = (
                "Pass a folder on a disk this process can write (a system folder such as /proc holds none)"
                if self.is_local
                else "Check that the bucket exists and the URL is spelled right"
            )
            raise StorageError(f"cannot write under {self.display()}: {exc}. {fix}.") from exc
        except StorageError as exc:
            if not is_unanswered(exc.__cause__):
                raise
            raise self._unreachable(exc) from exc
        self.remove(rel)

    def check_reachable(self) -> None:
        """One read under the root (is its record folder there), so that a reader whose endpoint refuses
        or never answers fails on a ``Storage.probe`` in seconds, naming the endpoint, rather than after
        every retry of its first listing (more than ten minutes against a silent one). Any other answer,
        an error included, is left to that listing, which reports it as before. A local root has no
        endpoint: nothing to probe."""
        if self.is_local:
            return
        meta = self.path(META_DIR)
        try:
            self.call("check", META_DIR, lambda: self.fs.exists(meta, **self._bound))
        except StorageError as exc:
            if is_unanswered(exc.__cause__):
                raise self._unreachable(exc) from exc

    def _unreachable(self, exc: StorageError) -> StorageError:
        given = getattr(self.fs, "endpoint_url", None) or getattr(self.fs, "client_kwargs", {}).get(
            "endpoint_url"
        )  # s3fs's, from storage_options
        at = f" at endpoint_url={redact(given)!r}" if isinstance(given, str) else ""
        return StorageError(f"AsyncCheckpointer(root={self.url!r}) cannot reach its storage{at}: {exc}")


class Put(NamedTuple):
    """One file put at the root: its size there, and whether it was linked (no byte was copied)."""

    size: int
    linked: bool


def _plain_copy(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with every nested plain dict copied (other values shared): botocore rewrites the
    ``retries`` of ``config_kwargs`` in place (``max_attempts: 2`` became ``total_max_attempts: 3``), and
    the dict is the user's, or their saved config's."""
    return {k: _plain_copy(v) if type(v) is dict else v for k, v in options.items()}


def _probe_options(root: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` for ``Storage.probe``: for s3://, botocore's ``config_kwargs`` with
    ``PROBE_ATTEMPTS`` attempts, so that a refused connection fails within seconds with botocore's error
    naming the endpoint, and a throttled probe (every rank of a large job probes at once) is tried again
    within the probe's bound (the user's other settings kept); other backends' options as given."""
    if _EXTRAS.get(str(fsspec.core.split_protocol(root)[0])) != "s3":
        return storage_options
    config = dict(storage_options.get("config_kwargs") or {})
    config["retries"] = {**(config.get("retries") or {}), "total_max_attempts": PROBE_ATTEMPTS}
    return {**storage_options, "config_kwargs": config}


def transfer_all(transfer: Callable[[T], R], items: Iterable[T], *, max_transfers: int, name: str) -> list[R]:
    """Run ``transfer(item)`` for every item, at most ``max_transfers`` at a time, on threads ``name-N``;
    return the results in the items' order.

    Blocks until all are done. The first failure cancels the transfers not yet started, waits for
    the running ones and is raised; one item runs on the calling thread (no pool for nothing).
    """
    todo = list(items)
    if len(todo) <= 1 or max_transfers <= 1:
        return [transfer(item) for item in todo]
    with ThreadPoolExecutor(min(max_transfers, len(todo)), thread_name_prefix=name) as pool:
        futures = [pool.submit(transfer, item) for item in todo]
        try:
            return [future.result() for future in futures]
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _temp_name(final: str) -> str:
    head, tail = os.path.split(final)
    return os.path.join(head, f".{tail}{TEMP_TAG}{uuid.uuid4().hex[:8]}")


def _link_durably(src: str, tmp: str, final: str) -> bool:
    """Make ``final`` a durable hard link of ``src`` (through ``tmp``); False where the two are on
    different filesystems or links are refused, and nothing was done. ``src`` is never changed: a link
    or rename that fails leaves the staged file and the root's previous files as they were."""
    if os.stat(src).st_dev != os.stat(os.path.dirname(tmp)).st_dev:
        return False
    try:
        os.link(src, tmp)
    except OSError as exc:
        if exc.errno in _CANNOT_LINK:  # a bind mount of the same disk reports EXDEV
            return False
        raise
    try:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the staged file was written without: now it is the root's
        finally:
            os.close(fd)
        _rename_durably(tmp, final)
    finally:
        _discard(tmp)
    return True


def _discard(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _rename_durably(tmp: str, final: str) -> None:
    os.replace(tmp, final)
    fd = os.open(os.path.dirname(final) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(exc: BaseException) -> str:
    """``Type: message``; a timeout without a message (fsspec's) says what it means."""
    text = str(exc) or ("no answer in time" if isinstance(exc, _TIMEOUTS) else "")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def fix_for(exc: BaseException) -> str:
    """What a user can do about a storage error (credentials, a full disk, a missing bucket, ...)."""
    if isinstance(exc, PermissionError) or "credential" in str(exc).lower() or "AccessDenied" in str(exc):
        return "Check the credentials in storage_options or the environment, and the permissions of the root."
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return "The disk is full: free space or point the root elsewhere."
    if is_unanswered(exc):  # before the bucket: the endpoint's URL may hold the word
        return (
            "Check the root URL, the network and storage_options: the endpoint (s3://: {'client_kwargs': "
            "{'endpoint_url': URL}}, or AWS_ENDPOINT_URL in the environment) and that its server is up."
        )
    if "NoSuchBucket" in str(exc) or "bucket" in str(exc).lower():
        return "Check that the bucket exists and the URL is spelled right."
    return "Check the root URL, the network and storage_options."
