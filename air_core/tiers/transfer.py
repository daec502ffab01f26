"""Moving committed checkpoints between ranks: a ``Package`` (one commit of a local root) sent over a gloo
process group, each file streamed into a ``Sink`` as it arrives, checked against the manifest, placed.

The group is the tier's own (``side_groups.TIER``), never the training's, so a replication running on
a background thread issues no collective on the group the training thread uses. An exchange is three
rounds of point-to-point messages: sizes, headers, then the bytes. In the last round every sender posts
all its sends at once, from its files mapped into memory (copy-on-write, nothing copied before gloo reads
it), and only then receives, so two ranks that send to each other cannot deadlock. A receiver takes each
file in ``CHUNK``-sized messages into a few reused buffers, ``WINDOW`` of them in flight: the chunks
that arrived are checked (each its own CRC-32, joined in order: ``checksum.py``) and written by worker
threads while the next ones arrive, and a whole part is never held in memory. A resume, which waits
for its copy, checks on a thread per core, up to the window (``RESTORE_THREADS``); a replica, made
while training runs, on one. A copy is committed by the same rule as its original: every file's size and
CRC-32 match the manifest before the manifest is placed (``StagedFiles.commit``).
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .. import layout, spares
from ..checksum import THREADS, crc32_combine
from ..errors import CorruptCheckpointError
from ..manifest import FileEntry, Manifest
from ..storage import Storage

CHUNK = 8 << 20
"""Bytes per message of a file."""
WINDOW = 4
"""A receiver's messages in flight (each into a reused buffer of ``CHUNK`` bytes)."""
RESTORE_THREADS = min(WINDOW, THREADS)
"""The threads a resume's receiver checks and writes on (it waits for the copy; a replica uses one)."""


def local_storage(root: str) -> Storage:
    """A node-local root of the tier (a local disk: few retries)."""
    return Storage(root, storage_options={}, retries=2, retry_backoff_seconds=0.1)


@dataclass(frozen=True)
class Package:
    """One committed checkpoint of a local root, to send: its manifest, and the folder its files are in."""

    name: str
    """The checkpoint's name; "" for an empty package (the sender had nothing to send)."""
    root: str = ""
    manifest: bytes = b""
    only: frozenset[str] | None = None
    """The files to send (paths in the manifest); None: every one."""

    def entries(self) -> tuple[FileEntry, ...]:
        if not self.name:
            return ()
        files = Manifest.from_json(self.manifest, where=f"{self.root}/{self.name}").files
        return files if self.only is None else tuple(f for f in files if f.path in self.only)


EMPTY = Package("")


def read_package(storage: Storage, name: str) -> Package:
    """The committed checkpoint ``name`` of the local root ``storage`` (its manifest read; files stay)."""
    return Package(name, storage.path(""), storage.read_bytes(layout.manifest_path(name)))


@dataclass(frozen=True)
class Received:
    """What one sender's package came to: its manifest, and each file's size and CRC-32 as received (the
    bytes went to the receiver's sink)."""

    name: str
    manifest: bytes = b""
    sizes: dict[str, int] = field(default_factory=dict)
    crc32: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return len(self.manifest) + sum(self.sizes.values())

    def check(self, *, where: str, only: frozenset[str] | None = None) -> Manifest:
        """The manifest, once every file it names (of ``only``, the files asked for, when given) arrived
        whole with its CRC-32.

        Raises:
            CorruptCheckpointError: a file is missing or does not match.
        """
        manifest = Manifest.from_json(self.manifest, where=where)
        for entry in manifest.files:
            if only is not None and entry.path not in only:
                continue
            if self.sizes.get(entry.path) != entry.size or self.crc32.get(entry.path) != entry.crc32:
                raise CorruptCheckpointError(
                    f"{where}: the copy of {entry.path} received does not match its manifest",
                    path=entry.path,
                    reason="damaged in transfer",
                )
        return manifest


NOTHING = Received("")


class Sink(Protocol):
    """Where a receiver writes each chunk of each file as it arrives."""

    def expect(self, sizes: dict[str, int]) -> None:
        """The package's files and their sizes, before any of their bytes: open (or make) each one."""
        ...

    def write(self, path: str, offset: int, data: memoryview) -> None:
        """Write a chunk of a file ``expect`` opened; called from several threads at once."""
        ...

    def close(self) -> None: ...


class UnsyncedFiles:
    """A ``Sink`` into a transient local root (``restore-<r>/``: read right away, rebuilt at every resume):
    each file at its final place, no fsync, no rename."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._open: dict[str, int] = {}

    def target(self, path: str) -> str:
        return layout.local_path(self.root, path)

    def expect(self, sizes: dict[str, int]) -> None:
        for path in sizes:
            if path not in self._open:
                target = self.target(path)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                self._open[path] = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, path: str, offset: int, data: memoryview) -> None:
        os.pwrite(self._open[path], data, offset)

    def close(self, *, sync: bool = False) -> None:
        for fd in self._open.values():
            if sync:
                os.fsync(fd)
            os.close(fd)
        self._open.clear()


class StagedFiles(UnsyncedFiles):
    """A ``Sink`` into a replica root: files land beside their final places, and only ``commit`` (every
    CRC checked) makes them a commit: fsynced, renamed, the manifest last, the older copies dropped. The
    dropped copies' files are set aside, and the next copy is written over them (``spares.py``)."""

    def __init__(self, storage: Storage) -> None:
        super().__init__(storage.path(""))
        self.storage = storage
        self._temps: dict[str, str] = {}

    def target(self, path: str) -> str:
        return self._temps.setdefault(path, self.storage.local_temp(path))

    def expect(self, sizes: dict[str, int]) -> None:
        """Open each file: one that takes a spare cut to its size, the others made new."""
        temps = {rel: self.target(rel) for rel in sizes}
        taken = spares.take(self.storage, temps)
        for rel, temp in temps.items():
            if temp in taken:
                fd = self._open[rel] = os.open(temp, os.O_WRONLY)
                os.ftruncate(fd, sizes[rel])
        super().expect(sizes)

    def commit(self, received: Received) -> Manifest:
        """Place ``received`` as a committed checkpoint (``CorruptCheckpointError``: nothing placed)."""
        try:
            manifest = received.check(where=self.storage.display(layout.manifest_path(received.name)))
            self.close(sync=True)
            for entry in manifest.files:
                self.storage.place_local(self._temps.pop(entry.path), entry.path)
        except BaseException:
            self.abort()
            raise
        self.storage.write_bytes(layout.manifest_path(received.name), received.manifest)
        drop_commits(self.storage, keep={received.name}, recycle=True)
        return manifest

    def abort(self) -> None:
        """Remove what arrived of a copy that will not be committed."""
        self.close()
        for temp in self._temps.values():
            if os.path.exists(temp):
                os.remove(temp)
        self._temps.clear()


def drop_commits(storage: Storage, *, keep: set[str] | frozenset[str], recycle: bool = False) -> None:
    """Remove every checkpoint of the local root ``storage`` (its manifest, files, records) but ``keep``;
    with ``recycle`` the files of the newest dropped one are set aside for the next copy (``spares.py``)."""
    sizes = storage.sizes()
    names = {n for rel in sizes if (n := layout.checkpoint_of(rel)) is not None} - keep
    newest = max(names, default="")
    for name in sorted(names):
        commit_record = layout.manifest_path(name)
        manifest = storage.read_if_present(commit_record)
        files: list[str] = []
        if manifest is not None:
            try:
                files = [f.path for f in Manifest.from_json(manifest, where=name).files if f.path in sizes]
            except CorruptCheckpointError:
                files = []
        storage.remove(commit_record)  # the manifest first: never a commit missing files
        records = [rel for rel in sizes if layout.checkpoint_of(rel) == name and rel != commit_record]
        if recycle and name == newest:
            spares.set_aside(storage, files)
        else:
            for rel in files:
                storage.remove(rel)
        for rel in records:
            storage.remove(rel)
        for rel in (commit_record, *files, *records):
            sizes.pop(rel, None)


def exchange(
    package: Package, send_to: list[int], receive_from: dict[int, Sink], group: Any, *, threads: int = 1
) -> dict[int, Received]:
    """Send ``package`` to each rank of ``send_to`` and receive one package from each rank of
    ``receive_from`` into its sink, over ``group`` (global ranks), checking and writing what arrives on
    ``threads`` threads. Every rank of an exchange calls it with matching pairs; an empty package
    (``EMPTY``) still takes part."""
    entries = package.entries()
    header = json.dumps(
        {
            "name": package.name,
            "paths": [e.path for e in entries],
            "sizes": [len(package.manifest), *(e.size for e in entries)],
        }
    ).encode()
    lengths = {src: torch.zeros(1, dtype=torch.int64) for src in receive_from}
    _run(
        [dist.isend(torch.tensor([len(header)], dtype=torch.int64), dst, group=group) for dst in send_to]
        + [dist.irecv(t, src, group=group) for src, t in lengths.items()]
    )
    got = {src: torch.empty(int(t.item()), dtype=torch.uint8) for src, t in lengths.items()}
    _run(
        [dist.isend(_tensor(bytearray(header)), dst, group=group) for dst in send_to]
        + [dist.irecv(t, src, group=group) for src, t in got.items()]
    )
    heads = {src: json.loads(bytes(t.numpy())) for src, t in got.items()}
    with _Mapped(package, entries) as bodies, ThreadPoolExecutor(threads, "air-receive") as pool:
        sends = [dist.isend(c, dst, group=group) for body in bodies for c in _chunks(body) for dst in send_to]
        received = {
            src: _receive(src, heads[src], receive_from[src], group, pool, threads)
            for src in sorted(receive_from)
        }
        _run(sends)
    return received


def _receive(
    src: int, head: dict[str, Any], sink: Sink, group: Any, pool: Executor, threads: int
) -> Received:
    """Rank ``src``'s package: the manifest into memory, each file chunk by chunk into ``sink``.

    ``WINDOW`` chunks are in flight at any time, each into a buffer of its own; a chunk that arrived is
    checked (its own CRC-32) and written by ``pool`` while the next ones arrive, and its buffer is reused
    once that is done. The chunks' CRCs are joined in order (``crc32_combine``).
    """
    if not head["name"]:
        return NOTHING
    manifest = torch.empty(head["sizes"][0], dtype=torch.uint8)
    _run([dist.irecv(c, src, group=group) for c in _chunks(manifest)])
    paths, sizes = head["paths"], head["sizes"][1:]
    sink.expect(dict(zip(paths, sizes, strict=True)))
    plan = [
        (k, offset, min(CHUNK, size - offset))
        for k, size in enumerate(sizes)
        for offset in range(0, size, CHUNK)
    ]
    ring = [
        torch.empty(min(CHUNK, max(sizes, default=0)), dtype=torch.uint8)
        for _ in range(min(WINDOW + threads, len(plan)))
    ]

    def check_and_write(step: int, slot: int) -> int:
        k, offset, n = plan[step]
        data = ring[slot][:n].numpy().data
        crc = zlib.crc32(data)
        sink.write(paths[k], offset, data)
        return crc

    free = deque(range(len(ring)))
    arriving: deque[tuple[int, Any]] = deque()  # (slot, its receive), in the plan's order
    handling: deque[tuple[int, Future[int]]] = deque()  # (slot, its check and write), in the plan's order
    crcs: list[Future[int]] = []
    for step in range(len(plan)):
        while len(crcs) + len(arriving) < min(len(plan), step + WINDOW):
            if not free:
                slot, done = handling.popleft()
                done.result()
                free.append(slot)
            slot = free.popleft()
            n = plan[len(crcs) + len(arriving)][2]
            arriving.append((slot, dist.irecv(ring[slot][:n], src, group=group)))
        slot, work = arriving.popleft()
        work.wait()
        crcs.append(pool.submit(check_and_write, step, slot))
        handling.append((slot, crcs[-1]))
    files = [0] * len(paths)
    for (k, _, n), crc in zip(plan, crcs, strict=True):
        files[k] = crc32_combine(files[k], crc.result(), n)
    return Received(
        head["name"],
        bytes(manifest.numpy()),
        dict(zip(paths, sizes, strict=True)),
        dict(zip(paths, files, strict=True)),
    )


class _Mapped:
    """The manifest and every file of a package as tensors to send: the files mapped copy-on-write (gloo
    reads the page cache; nothing is copied first), unmapped when the sends are done."""

    def __init__(self, package: Package, entries: tuple[FileEntry, ...]) -> None:
        self._package, self._entries = package, entries
        self._maps: list[mmap.mmap] = []

    def __enter__(self) -> list[torch.Tensor]:
        if not self._package.name:
            return []
        bodies = [_tensor(bytearray(self._package.manifest))]
        for entry in self._entries:
            if entry.size == 0:
                bodies.append(torch.empty(0, dtype=torch.uint8))
                continue
            with open(layout.local_path(self._package.root, entry.path), "rb") as f:
                mapped = mmap.mmap(f.fileno(), entry.size, access=mmap.ACCESS_COPY)
            self._maps.append(mapped)
            bodies.append(torch.frombuffer(mapped, dtype=torch.uint8))
        return bodies

    def __exit__(self, *exc: object) -> None:
        for mapped in self._maps:
            try:
                mapped.close()
            except BufferError:  # a tensor still views it: it goes with the tensor
                pass
        self._maps.clear()


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    return [t[i : i + CHUNK] for i in range(0, t.numel(), CHUNK)]


def _tensor(data: bytearray) -> torch.Tensor:
    return torch.frombuffer(data, dtype=torch.uint8)


def _run(works: list[Any]) -> None:
    for work in works:
        work.wait()
