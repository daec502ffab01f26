"""What the pipeline tells the outside: phase events and per-save / per-restore records.

The pipeline never imports the metrics layer; it calls the ``Listener`` objects it was given. Phase
events mark the moments a fault-injection test may kill the process at; records carry the figures
the metrics layer logs. A listener that raises is logged once and ignored: metrics never fail a save.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

logger = logging.getLogger(__name__)

Phase = Literal[
    "snapshot_start",
    "snapshot_done",
    "serialize_start",
    "staged",
    "upload_start",
    "uploaded",
    "part_written",
    "commit_start",
    "committed",
    "retention_start",
    "retention_deleted",
    "restore_start",
    "failed",
]


@dataclass(frozen=True)
class PhaseEvent:
    """A save, a retention delete or a restore reached ``phase`` (emitted on the thread doing it)."""

    phase: Phase
    name: str
    step: int
    rank: int


@dataclass(frozen=True)
class SaveRecord:
    """The latency of one save, delivered once it committed (or failed: ``error`` is set)."""

    name: str
    step: int
    rank: int
    wait_seconds: float
    """Time ``save`` waited for an earlier save to free a buffer (backpressure)."""
    blocking_seconds: float
    """Time ``save`` held the training thread, the wait included."""
    staging_seconds: float
    """Serialize + checksum + write to the staging folder (or straight to a local destination)."""
    upload_seconds: float
    commit_seconds: float
    """From this rank's files uploaded to the manifest written (rank 0) or seen (other ranks)."""
    total_seconds: float
    """From ``save`` called to committed: the time until the checkpoint is durable."""
    bytes: int
    spilled_bytes: int
    error: str = ""
    staged_bytes: int = 0
    """Written into the local staging folder (0 for a local root written in place)."""
    uploaded_bytes: int = 0
    """Sent to the root by a copy or over the network."""
    linked_bytes: int = 0
    """Handed to a local root on the staging folder's filesystem by a hard link: no byte copied."""
    in_place_bytes: int = 0
    """Written in place at a local root without staging (the direct path). Every byte a save put at the
    root is uploaded, linked or written in place."""
    staging_disk_bytes: int = 0
    """What this node's staging folder held once this save was serialized (its files, its spill and the
    checkpoints the cache keeps): the save's peak disk use there."""
    # On rank 0 of a multi-rank save that committed, staged, uploaded, linked and in-place bytes are every
    # rank's (from their part records); elsewhere, this rank's.

    @property
    def throughput_bytes_per_second(self) -> float:
        busy = self.staging_seconds + self.upload_seconds
        return self.bytes / busy if busy > 0 else 0.0


@dataclass(frozen=True)
class RestoreRecord:
    """One restore: how long it took, where the time went and where the bytes came from."""

    name: str
    step: int
    rank: int
    seconds: float
    """From the call (``fetch``/``load``) to the files verified, or to the state unpickled (``load``);
    for the reads inside ``AsyncCheckpointer.restoring()``, the whole block."""
    source: Literal["local", "cache", "remote"]
    bytes: int
    find_seconds: float = 0.0
    """Listing the root and judging its manifests to pick the newest committed (0: the caller named it)."""
    fetch_seconds: float = 0.0
    """Getting verified local copies of the files: the CRC-32 check of a cached or local copy, or the
    download (with its check)."""
    load_seconds: float = 0.0
    """``torch.load`` of the file (``AsyncCheckpointer.load`` only: a ``fetch`` leaves it to the caller);
    inside ``restoring()``, the block's time that was not finding or fetching."""
    tier: Literal["remote", "local", "replica"] = "remote"
    """The tier the checkpoint came from: the root, this node's local tier, or a partner's copy
    (``air_core.tiers``; then ``seconds`` also counts gathering the pieces)."""


@dataclass(frozen=True)
class DeleteRecord:
    """Retention (or an explicit removal) deleted one checkpoint from the root (rank 0)."""

    name: str
    step: int
    bytes: int
    """The listed bytes of the files the delete removed."""


Event = PhaseEvent | SaveRecord | RestoreRecord | DeleteRecord


class Listener(Protocol):
    """Receives events. Called on the training thread (snapshot, restore) or the writer thread
    (every later phase) of each rank; must return quickly and must not call back into the checkpointer."""

    def on_event(self, event: Event) -> None: ...


class Emitter:
    """Fans events out to listeners, shielding the pipeline from their errors."""

    def __init__(self, listeners: Iterable[Listener]) -> None:
        self._listeners = list(listeners)
        self._warned: set[int] = set()

    def __call__(self, event: Event) -> None:
        for listener in self._listeners:
            try:
                listener.on_event(event)
            except Exception:
                if id(listener) not in self._warned:
                    self._warned.add(id(listener))
                    logger.warning(
                        "listener %r failed; its later errors are ignored", listener, exc_info=True
                    )
