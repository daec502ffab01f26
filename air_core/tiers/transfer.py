"""Moving committed checkpoints between ranks: a ``Package`` (manifest and files of one commit) read from a
local root, sent and received over a gloo process group, verified and placed as a committed copy.

The group is the tier's own (``partners.side_group``), never the training's, so a replication running on
a background thread issues no collective on the group the training thread uses. Every exchange is three
rounds of non-blocking point-to-point messages (sizes, headers, bytes), all posted before any is waited
for, so two ranks that send to each other cannot deadlock. A receiver checks each file's CRC-32 against
the manifest before it places the manifest, so a copy is committed by the same rule as the original.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import layout
from ..errors import CorruptCheckpointError
from ..manifest import Manifest
from ..storage import Storage


@dataclass(frozen=True)
class Package:
    """One commit of a local root: its manifest and every file it names (bytes in memory)."""

    name: str
    """The checkpoint's name; "" for an empty package (the sender had nothing to send)."""
    manifest: bytes = b""
    files: dict[str, bytes] = field(default_factory=dict)

    def info(self, *, where: str) -> Manifest:
        return Manifest.from_json(self.manifest, where=where)

    @property
    def nbytes(self) -> int:
        return len(self.manifest) + sum(len(b) for b in self.files.values())


EMPTY = Package("")


def local_storage(root: str) -> Storage:
    """A node-local root of the tier (a local disk: few retries)."""
    return Storage(root, storage_options={}, retries=2, retry_backoff_seconds=0.1)


def read_package(storage: Storage, name: str) -> Package:
    """The committed checkpoint ``name`` of the local root ``storage``."""
    data = storage.read_bytes(layout.manifest_path(name))
    manifest = Manifest.from_json(data, where=storage.display(layout.manifest_path(name)))
    return Package(name, data, {f.path: storage.read_bytes(f.path) for f in manifest.files})


def place_package(storage: Storage, package: Package, *, keep: frozenset[str] = frozenset()) -> Manifest:
    """Write ``package`` into the local root ``storage`` as a committed checkpoint: every file checked
    against its CRC-32 and placed, the manifest last; then every other commit there goes but ``keep``.

    Raises:
        CorruptCheckpointError: a file does not match the manifest (nothing is committed).
    """
    manifest = checked(package, where=storage.display(layout.manifest_path(package.name)))
    for entry in manifest.files:
        storage.write_bytes(entry.path, package.files[entry.path])
    storage.write_bytes(layout.manifest_path(package.name), package.manifest)
    drop_commits(storage, keep={package.name, *keep})
    return manifest


def checked(package: Package, *, where: str) -> Manifest:
    """``package``'s manifest, once every file it names is there with its size and CRC-32.

    Raises:
        CorruptCheckpointError: a file is missing or does not match.
    """
    manifest = package.info(where=where)
    for entry in manifest.files:
        data = package.files.get(entry.path)
        if data is None or len(data) != entry.size or zlib.crc32(data) != entry.crc32:
            raise CorruptCheckpointError(
                f"{where}: the copy of {entry.path} received does not match its manifest",
                path=entry.path,
                reason="damaged in transfer",
            )
    return manifest


def drop_commits(storage: Storage, *, keep: set[str] | frozenset[str]) -> None:
    """Remove every checkpoint of the local root ``storage`` (its files, then its records) but ``keep``."""
    sizes = storage.sizes()
    names = {n for rel in sizes if (n := layout.checkpoint_of(rel)) is not None} - keep
    for name in sorted(names):
        manifest = storage.read_if_present(layout.manifest_path(name))
        files: list[str] = []
        if manifest is not None:
            try:
                files = [f.path for f in Manifest.from_json(manifest, where=name).files]
            except CorruptCheckpointError:
                files = []
        records = [rel for rel in sizes if layout.checkpoint_of(rel) == name]
        manifest_rel = layout.manifest_path(name)
        for rel in [manifest_rel, *files, *records]:  # the manifest first: never a commit missing files
            if rel in sizes:
                storage.remove(rel)
                sizes.pop(rel)


def exchange(outgoing: dict[int, Package], incoming: list[int], group: Any) -> dict[int, Package]:
    """Send each ``outgoing[dst]`` to rank ``dst`` and receive one package from each rank of ``incoming``,
    over ``group`` (global ranks). Every rank of an exchange must call it with matching pairs."""
    headers = {dst: _header(p) for dst, p in outgoing.items()}
    lengths = {src: torch.zeros(1, dtype=torch.int64) for src in incoming}
    _run(
        [
            dist.isend(torch.tensor([len(h)], dtype=torch.int64), dst, group=group)
            for dst, h in headers.items()
        ]
        + [dist.irecv(t, src, group=group) for src, t in lengths.items()]
    )
    got = {src: torch.empty(int(t.item()), dtype=torch.uint8) for src, t in lengths.items()}
    _run(
        [dist.isend(_tensor(h), dst, group=group) for dst, h in headers.items()]
        + [dist.irecv(t, src, group=group) for src, t in got.items()]
    )
    heads = {src: json.loads(bytes(t.numpy())) for src, t in got.items()}
    sends = []
    for dst, package in outgoing.items():
        sends += [dist.isend(_tensor(b), dst, group=group) for b in _bodies(package) if b]
    buffers: dict[int, list[torch.Tensor]] = {
        src: [torch.empty(n, dtype=torch.uint8) for n in head["sizes"]] for src, head in heads.items()
    }
    recvs = [dist.irecv(t, src, group=group) for src, ts in buffers.items() for t in ts if t.numel()]
    _run(sends + recvs)
    result = {}
    for src, head in heads.items():
        blobs = [bytes(t.numpy()) for t in buffers[src]]
        if not head["name"]:
            result[src] = EMPTY
            continue
        result[src] = Package(head["name"], blobs[0], dict(zip(head["paths"], blobs[1:], strict=True)))
    return result


def _header(package: Package) -> bytes:
    paths = list(package.files)
    sizes = [len(b) for b in _bodies(package)] if package.name else []
    return json.dumps({"name": package.name, "paths": paths, "sizes": sizes}).encode()


def _bodies(package: Package) -> list[bytes]:
    return [package.manifest, *package.files.values()] if package.name else []


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _run(works: list[Any]) -> None:
    for work in works:
        work.wait()
