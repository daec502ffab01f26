"""What a committed checkpoint is: ``Manifest``, the per-rank ``PartRecord``s (and ``FailureRecord``s),
and their JSON form.

Records only: where they live is ``layout.py``, reading and writing them is ``commit.py`` and
``catalog.py``. Readers trust nothing without a manifest. Checksums are CRC-32 (zlib, ~6 GB/s,
releases the GIL): they catch corruption and truncation, not tampering. Every path a record names is
checked when it is read (no absolute path, no ``..``), so a hostile manifest cannot make a reader
touch other files; such a record is a ``CorruptCheckpointError``.
"""

from __future__ import annotations

import functools
import json
import platform
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

from . import procfs
from .errors import CorruptCheckpointError
from .layout import unsafe_reason

FORMAT_VERSION = 1
Status = Literal["committed", "partial", "corrupt"]


def check_relpath(path: str, *, where: str) -> str:
    """Return ``path`` if it is a safe relative POSIX path, else raise ``CorruptCheckpointError``.

    For paths *read* from a record; a caller's bad argument is ``config.check_filename``'s job.
    """
    why = unsafe_reason(path)
    if why:
        raise CorruptCheckpointError(
            f"{where}: refusing file path {path!r}: {why}.", path=str(path), reason="unsafe path"
        )
    return path


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint, as uploaded."""

    path: str
    size: int
    crc32: int
    rank: int


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint."""

    name: str
    step: int
    time: float
    world_size: int
    launch_id: str
    files: tuple[FileEntry, ...]
    versions: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def files_of(self, rank: int) -> list[FileEntry]:
        return [f for f in self.files if f.rank == rank]

    def to_json(self) -> bytes:
        return _dump("air-manifest", self, indent=1)

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        return _load(cls, "air-manifest", data, where)


@dataclass(frozen=True)
class PartRecord:
    """What one rank uploaded for one checkpoint; rank 0 merges them into the manifest."""

    name: str
    step: int
    rank: int
    launch_id: str
    files: tuple[FileEntry, ...]
    complete: bool
    """False for the intent written before the files (so a crash leaves a findable partial)."""
    extents: dict[str, list[list[int]]] = field(default_factory=dict)
    """Per bundled file (``serializer.Bundle``): [offset, length] of each item, for the commit's
    finalizer (a ``torch.distributed.checkpoint`` save's ``.metadata``)."""
    attempt: int = 1
    """Which save of this name in this launch (2 after one failed): an earlier attempt's record is stale."""
    moved: dict[str, int] = field(default_factory=dict)
    """Bytes this rank ``staged``, ``uploaded``, ``linked`` and wrote ``in_place`` for this save
    (``events.SaveRecord``)."""
    host: str = ""
    pid: int = 0
    pid_started: str = ""
    pid_space: str = ""
    """The process that writes the part (``procfs.Process``): a rank waiting for it on the same host stops
    waiting when it died (empty in records of earlier versions)."""

    @property
    def process(self) -> procfs.Process:
        return procfs.Process(self.host, self.pid, self.pid_started, self.pid_space)

    def to_json(self) -> bytes:
        return _dump("air-part", self)

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> PartRecord:
        return _load(cls, "air-part", data, where)


@dataclass(frozen=True)
class FailureRecord:
    """One rank's failed part of one attempt of a save (``layout.failure_path``): the ranks waiting for
    that part or for the commit stop waiting, and ``air ls`` says why the checkpoint is partial."""

    name: str
    step: int
    rank: int
    launch_id: str
    attempt: int
    error: str

    def to_json(self) -> bytes:
        return json.dumps({"format": "air-failure", "version": FORMAT_VERSION, **asdict(self)}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> FailureRecord | None:
        """The record, or None for anything else (a torn write: whoever waits goes on waiting)."""
        try:
            body = json.loads(data)
            if body.pop("format") != "air-failure":
                return None
            body.pop("version")
            return cls(**body)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


def _dump(kind: str, record: Manifest | PartRecord, indent: int | None = None) -> bytes:
    body = {"format": kind, "version": FORMAT_VERSION, **asdict(record)}
    if not body.get("extents", True):
        del body["extents"]  # plain saves' records stay as they were
    if body.get("attempt") == 1:
        del body["attempt"]  # and so do first attempts'
    if body.get("moved") == {}:
        del body["moved"]
    return json.dumps(body, indent=indent).encode()


R = TypeVar("R", Manifest, PartRecord)


def _load(cls: type[R], kind: str, data: bytes, where: str) -> R:
    """Parse and validate a record; anything malformed or unsafe is a ``CorruptCheckpointError``."""
    try:
        body = json.loads(data)
        if body.pop("format") != kind:
            raise ValueError(f"not an {kind} record")
        if body.pop("version") > FORMAT_VERSION:
            raise ValueError("written by a newer air-plugins; upgrade to read it")
        files = tuple(FileEntry(**f) for f in body.pop("files"))
        record = cls(files=files, **body)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"{where}: unreadable {kind} ({exc})", path=where, reason=f"unreadable {kind}"
        ) from exc
    for f in record.files:
        check_relpath(f.path, where=where)
    return record


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint as found under the root: its status, and its manifest when committed."""

    name: str
    step: int
    status: Status
    reason: str = ""
    manifest: Manifest | None = None

    @property
    def time(self) -> float | None:
        return self.manifest.time if self.manifest else None

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes if self.manifest else 0


def library_versions() -> dict[str, str]:
    """Versions recorded in every manifest, to explain a later load failure: those of the code this
    process runs, looked up once (a lookup scans the installed distributions: milliseconds per commit)."""
    return dict(_versions())


@functools.cache
def _versions() -> tuple[tuple[str, str], ...]:
    from importlib import metadata

    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        versions["air-plugins"] = metadata.version("air-plugins")
    except metadata.PackageNotFoundError:
        versions["air-plugins"] = "unknown"
    return tuple(versions.items())
