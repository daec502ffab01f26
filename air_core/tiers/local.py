"""``LocalTier``: one rank's node-local checkpoints, and the copies it keeps of its partners'.

Every ``local_every_n_steps`` the session saves this rank's part of a checkpoint (the same files it gives
the root) through an ``AsyncCheckpointer`` of its own node-local root, with one rank: the same snapshot,
buffers reused across saves, writer thread and manifest-and-CRC commit as the root's saves, but nothing
uploaded. A thread of the tier then sends each committed one to the rank's partners (``partners.py``)
and places the copies it receives from its sources, verified, in their replica roots; then it drops the
older commits, but the newest one every partner has a copy of. Every rank saves at the same steps, so
the exchanges pair up in order; a save that failed still takes part (an empty package), and a failure
of the tier is logged, never raised into training.

A save is *settled* once every rank's save of its step is committed and copied (or failed): the tier's
thread meets the other ranks' at a barrier of the tier's group after each exchange. The session waits
for it before the next optimizer step (``wait_settled``), so a failure loses at most the steps since the
newest local save, never also a save still in flight.

On disk, under ``<local_dir>/air-<job>/``: ``rank-<r>/`` (this rank's own), ``replica-<s>/`` (copies of
rank ``s``'s), ``restore-<r>/`` (the checkpoint a resume assembled, ``recover.py``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from .. import dcp, spares
from ..catalog import read_catalog
from ..checkpointer import AsyncCheckpointer
from ..config import CheckpointerConfig
from ..dcp.planning import SavePlans
from ..handle import SaveHandle
from ..storage import location
from .transfer import EMPTY, Package, StagedFiles, drop_commits, exchange, local_storage, read_package

logger = logging.getLogger(__name__)
_NAME = re.compile(r"^local-s(\d{9})-w(\d+)$")
_NEVER_BY_COUNT = 1 << 30  # the tier's thread drops older commits once the newest is replicated


def job_folder(local_dir: str, root: str) -> str:
    """The folder of one job's local tier: named after its root, so jobs sharing a node never mix."""
    digest = hashlib.sha1(location(root).encode()).hexdigest()[:16]
    return os.path.join(os.path.abspath(local_dir), f"air-{digest}")


def own_root(base: str, rank: int) -> str:
    return os.path.join(base, f"rank-{rank:05d}")


def replica_root(base: str, rank: int) -> str:
    return os.path.join(base, f"replica-{rank:05d}")


def tier_name(step: int, world_size: int) -> str:
    """The name of every rank's local checkpoint of ``step`` (the same on every rank and node)."""
    return f"local-s{step:09d}-w{world_size}"


def parse_name(name: str) -> tuple[int, int] | None:
    """(step, world size) of a ``tier_name``, or None for any other name."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def rewind(base: str, *, rank: int, sources: Iterable[int], step: int) -> list[str]:
    """Drop this rank's local checkpoints and the copies it keeps of ``sources``' that are newer than
    ``step``, where this launch's training starts, and return their names.

    They belong to a run this launch does not continue: it resumed from an older checkpoint (a rollback,
    or a relaunch from a root's checkpoint older than the tier's newest), or started afresh. Kept, a later
    resume would take them for the newest state, and this launch's saves of the same steps would find
    their names committed. Each rank drops only the folders it writes (no rank writes a local save before
    every rank's training started). Another world size's folders on this node are left alone."""
    dropped: list[str] = []
    for root in (own_root(base, rank), *(replica_root(base, s) for s in sources)):
        if not os.path.isdir(root):
            continue
        storage = local_storage(root)
        names = {i.name for i in read_catalog(storage).infos}
        stale = {n for n in names if (parsed := parse_name(n)) is not None and parsed[0] > step}
        if stale:
            drop_commits(storage, keep=names - stale)
            dropped += sorted(stale)
    return dropped


class LocalTier:
    """This rank's local checkpoints and their replication (see the module docstring).

    Args:
        base: the job's folder on this node (``job_folder``).
        template: the session's checkpointer settings (buffers, writer); root, ranks and retention are the
            tier's.
        group: the tier's gloo group (``side_groups.TIER``), or None with one rank.
        send_to / receive_from: the ranks that keep copies of this rank's checkpoints / whose it keeps.
    """

    def __init__(
        self,
        base: str,
        *,
        rank: int,
        world_size: int,
        launch_id: str,
        template: CheckpointerConfig,
        group: Any,
        send_to: list[int],
        receive_from: list[int],
    ) -> None:
        self.base, self.rank, self.world_size = base, rank, world_size
        config = replace(
            template.for_root(own_root(base, rank), rank=0, world_size=1, launch_id=launch_id),
            staging_dir=None,
            storage_options={},
            keep_last=_NEVER_BY_COUNT,
            max_in_flight=1,
            on_busy="wait",
            recycle_files=True,  # each save is written over the files of the one it dropped (``spares.py``)
            label=f"rank {rank}'s local tier",  # its checkpointer is a one-rank one (rank 0 of 1)
        )
        self.checkpointer = AsyncCheckpointer.from_config(config)
        self._group = group
        self._send_to, self._receive_from = send_to, receive_from
        self._replicas = {s: local_storage(replica_root(base, s)) for s in receive_from}
        self._queue: queue.Queue[SaveHandle | None] = queue.Queue()
        self._settling = threading.Condition()
        self._settled_through = -1
        self.settled: list[str] = []
        """The local checkpoints committed and copied to every partner (as far as this rank's sends go)."""
        self.broken = ""
        """Why replication stopped (a partner is gone), or ""."""
        self._thread = threading.Thread(target=self._run, name=f"air-local-r{rank}", daemon=True)
        self._thread.start()

    def save(
        self,
        files: Mapping[str, Any],
        *,
        step: int,
        in_order: Iterable[torch.Tensor] = (),
        gated: Iterable[torch.Tensor] = (),
    ) -> SaveHandle:
        """Snapshot this rank's ``files`` into local checkpoint ``tier_name(step)``; committed, replicated
        and the older ones dropped in the background."""
        handle = self.checkpointer.save_files(
            files, step=step, name=tier_name(step, self.world_size), in_order=in_order, gated=gated
        )
        self._queue.put(handle)
        return handle

    def save_sharded(
        self,
        folders: Mapping[str, dict[str, Any]],
        files: Mapping[str, Any],
        *,
        step: int,
        plans: SavePlans,
        in_order: Iterable[torch.Tensor] = (),
        gated: Iterable[torch.Tensor] = (),
    ) -> SaveHandle:
        """As ``save``, with this rank's shards of each DCP folder (every rank, together: DCP plans with
        the job's group unless ``plans`` repeat). Each folder gets this rank's share of its ``.metadata``
        (``dcp.part_metadata``); a resume merges the shares (``recover``)."""
        name = tier_name(step, self.world_size)
        handle = dcp.save(
            self.checkpointer, folders, step=step, name=name, files=files, plans=plans, rank=self.rank,
            in_order=in_order, gated=gated,
        )  # fmt: skip
        self._queue.put(handle)
        return handle

    def _run(self) -> None:
        try:
            while (handle := self._queue.get()) is not None:
                package = self._committed(handle)
                if (self._send_to or self._receive_from) and not self.broken:
                    self._replicate(package)
                if package.name and not self.broken:
                    self.settled.append(package.name)
                self._meet()
                self._settle(handle.step)
                if package.name:
                    self._drop_older(handle.step)
        finally:  # closed, or the thread failed: nobody waits for a save of this tier again
            self._settle(_NEVER_BY_COUNT)

    def _settle(self, step: int) -> None:
        with self._settling:
            self._settled_through = step
            self._settling.notify_all()

    def wait_settled(self, step: int, timeout: float) -> bool:
        """Block until every rank's save of ``step`` is settled (see the module docstring) or the tier
        stopped; False when ``timeout`` seconds passed first. The save stops yielding the CPU meanwhile."""
        self.checkpointer.hurry()
        with self._settling:
            return self._settling.wait_for(lambda: self._settled_through >= step, timeout)

    def _meet(self) -> None:
        """Wait for every rank's thread to reach this point of the same save (the tier's group)."""
        if self._group is None or self.broken:
            return
        try:
            dist.barrier(group=self._group)
        except Exception as exc:  # a rank is gone
            self.broken = f"{type(exc).__name__}: {exc}"
            logger.warning("rank %d: the local tier lost a rank: %s", self.rank, self.broken)

    def _drop_older(self, step: int) -> None:
        """Drop the commits before ``step``, but the newest one every partner has (while ``step``'s copies
        are missing); later saves, committed meanwhile, are the next round's."""
        keep = set(self.settled[-1:])
        try:
            for info in self.checkpointer.list(settle=False):
                if info.status == "committed" and info.step < step and info.name not in keep:
                    self.checkpointer.delete(info.name, even_newest=True)
        except Exception as exc:  # the next save's round tries again
            logger.warning("rank %d: older local checkpoints were not dropped: %s", self.rank, exc)

    def _committed(self, handle: SaveHandle) -> Package:
        try:
            handle.result()
            return read_package(self.checkpointer.storage, handle.name)
        except Exception as exc:  # the tier is an optimization: training goes on without it
            logger.warning("rank %d: local checkpoint %s failed: %s", self.rank, handle.name, exc)
            return EMPTY

    def _replicate(self, package: Package) -> None:
        sinks = {src: StagedFiles(self._replicas[src]) for src in self._receive_from}
        try:
            received = exchange(package, self._send_to, dict(sinks), self._group)
        except Exception as exc:  # a partner is gone (its node, most likely): no more copies this launch
            for sink in sinks.values():
                sink.abort()
            self.broken = f"{type(exc).__name__}: {exc}"
            logger.warning("rank %d: replication of local checkpoints stopped: %s", self.rank, self.broken)
            return
        for src, copy in received.items():
            if not copy.name:
                sinks[src].abort()
                continue
            try:
                sinks[src].commit(copy)
            except Exception as exc:
                logger.warning(
                    "rank %d: the copy of rank %d's %s was not kept: %s", self.rank, src, copy.name, exc
                )

    def close(self, timeout: float | None = None) -> bool:
        """Commit and replicate what is in flight, then close (bounded by ``timeout`` per part). Returns
        whether the tier's group is left as it was found: every exchange on it ended, none failed."""
        self._queue.put(None)
        self._thread.join(timeout)
        ended = not self._thread.is_alive()
        if not ended:
            logger.warning("rank %d: the local tier's replication did not finish in %ss", self.rank, timeout)
        else:
            for replica in self._replicas.values():  # the copies' spares (the own root's go with its writer)
                spares.clear(replica)
        self.checkpointer.close()
        return ended and not self.broken
