"""What is under a root: one listing, judged into committed, partial and corrupt checkpoints.

``read_catalog`` lists the root once and reads only small records: a manifest whose files are all
present at their sizes is ``committed``; a bad manifest or a missing or short file is ``corrupt``; no
manifest is ``partial`` (its part records say which files it wrote, so retention can remove them).
Checkpoints are ordered by their manifest's step, never by folder name or mtime. It never reads a
data file (checksums are ``staging.py``'s) and never deletes; the writer reuses one catalog for a
whole commit's retention instead of listing again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from . import layout
from .errors import CorruptCheckpointError
from .manifest import CheckpointInfo, FailureRecord, FileEntry, Manifest, PartRecord
from .storage import Storage


@dataclass(frozen=True)
class Catalog:
    """Every checkpoint under a root as of one listing, oldest first (``in_commit_order``)."""

    infos: tuple[CheckpointInfo, ...]
    recorded_files: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """For each checkpoint without a readable manifest: the data files its part records name."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Every file of the listing with its size."""

    @property
    def committed(self) -> list[CheckpointInfo]:
        return [i for i in self.infos if i.status == "committed"]

    @property
    def newest_committed(self) -> CheckpointInfo | None:
        committed = self.committed
        return committed[-1] if committed else None

    def files_of(self, info: CheckpointInfo) -> tuple[str, ...]:
        """The data files ``info`` names: its manifest's, else its part records'."""
        if info.manifest is not None:
            return tuple(f.path for f in info.manifest.files)
        return self.recorded_files.get(info.name, ())

    def owned_files(self, info: CheckpointInfo) -> tuple[str, ...]:
        """The files deleting ``info`` removes: its own, not those another checkpoint here also names (a
        file rewritten in place, like Lightning's ``last.ckpt``, belongs to the newer one)."""
        shared = {path for o in self.infos if o.name != info.name for path in self.files_of(o)}
        return tuple(path for path in self.files_of(info) if path not in shared)

    def bytes_of(self, info: CheckpointInfo) -> int:
        """The listed bytes of ``owned_files(info)``."""
        return sum(self.sizes.get(path, 0) for path in self.owned_files(info))

    def without(self, name: str) -> Catalog:
        """This catalog after checkpoint ``name`` was deleted."""
        return replace(self, infos=tuple(i for i in self.infos if i.name != name))


def read_catalog(storage: Storage) -> Catalog:
    """List ``storage`` once (fresh) and judge every checkpoint found under the record folder."""
    sizes = storage.sizes()
    record_files: dict[str, list[str]] = {}  # each checkpoint's files under its record folder
    for rel in sorted(sizes):
        if (name := layout.checkpoint_of(rel)) is not None:
            record_files.setdefault(name, []).append(rel)
    infos, recorded = [], {}
    for name in sorted(record_files):
        info = _judge(storage, name, sizes)
        if info.manifest is None:
            records = _part_records(storage, name, record_files[name])
            recorded[name] = tuple(sorted({f.path for r in records for f in r.files}))
            if info.status == "partial":
                step = max((r.step for r in records), default=-1)
                reason = f"no manifest ({len(records)} part record(s) found)"
                failures = _failures(storage, name, record_files[name])
                info = replace(info, step=step, reason="; ".join([reason, *failures]))
        infos.append(info)
    return Catalog(tuple(in_commit_order(infos)), recorded, sizes)


def in_commit_order(infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """Oldest first, by launch, then by step: the launches in the order of their first commits, each
    launch's checkpoints by step. A launch that resumed from an older checkpoint (a rollback, or a new run
    in the same folder) continues from there, so its checkpoints are newer than the higher steps of the
    launches before it, as a framework's ``last`` checkpoint would say; ordering by step alone resumed the
    abandoned run and let retention delete the new run's checkpoints first. Launches are ordered by their
    first commit's time (rank 0's clock): a launch starts after the one before it ended, a restart apart.
    Checkpoints without a manifest (partial) count with the newest launch."""
    first: dict[str, float] = {}
    for i in infos:
        if i.manifest is not None:
            launch = i.manifest.launch_id
            first[launch] = min(first.get(launch, i.manifest.time), i.manifest.time)
    newest = max(first.values(), default=0.0)

    def key(i: CheckpointInfo) -> tuple[float, int, float, str]:
        launch = first[i.manifest.launch_id] if i.manifest is not None else newest
        return (launch, i.step, i.time or 0.0, i.name)

    return sorted(infos, key=key)


def scan(storage: Storage) -> list[CheckpointInfo]:
    """Every checkpoint under the root, oldest first (one fresh listing, small reads)."""
    return list(read_catalog(storage).infos)


def size_problem(files: Iterable[FileEntry], sizes: dict[str, int]) -> str:
    """Why the listed sizes do not match ``files``, or ``""``."""
    for f in files:
        if f.path not in sizes:
            return f"file {f.path} is missing"
        if sizes[f.path] != f.size:
            return f"file {f.path} has {sizes[f.path]} bytes, the manifest says {f.size}"
    return ""


def _judge(storage: Storage, name: str, sizes: dict[str, int]) -> CheckpointInfo:
    mpath = layout.manifest_path(name)
    if mpath not in sizes:
        return CheckpointInfo(name, -1, "partial")
    try:
        manifest = Manifest.from_json(storage.read_bytes(mpath), where=storage.display(mpath))
    except (CorruptCheckpointError, FileNotFoundError) as exc:
        return CheckpointInfo(name, -1, "corrupt", str(exc))
    problem = size_problem(manifest.files, sizes)
    if problem:
        return CheckpointInfo(name, manifest.step, "corrupt", problem, manifest)
    return CheckpointInfo(name, manifest.step, "committed", "", manifest)


def _failures(storage: Storage, name: str, rels: list[str]) -> list[str]:
    """Why ranks failed their parts of the partial checkpoint ``name`` (its failure records among
    ``rels``, its record folder's files)."""
    lines = []
    for rel in rels:
        if layout.is_failure_record(rel, name):
            with contextlib.suppress(FileNotFoundError):
                record = FailureRecord.from_json(storage.read_bytes(rel))
                if record is not None:
                    lines.append(f"rank {record.rank} failed (attempt {record.attempt}): {record.error}")
    return lines


def _part_records(storage: Storage, name: str, rels: list[str]) -> list[PartRecord]:
    """The readable part records of checkpoint ``name`` among ``rels``, its record folder's files."""
    records = []
    for rel in rels:
        if layout.is_part_record(rel, name):
            with contextlib.suppress(CorruptCheckpointError, FileNotFoundError):
                records.append(PartRecord.from_json(storage.read_bytes(rel), where=rel))
    return records
