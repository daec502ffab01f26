"""What every rank calls: ``save`` (several DCP folders, one commit), ``load``, ``load_newest`` and
``load_into``. DCP's collectives run inside these calls, on the calling (training) thread."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from .. import layout
from ..checkpointer import AsyncCheckpointer
from ..config import check_name, check_step
from ..errors import ConfigError, CorruptCheckpointError
from ..handle import SaveHandle
from ..manifest import CheckpointInfo, PartRecord
from ..writer import Finalize
from .planning import SavePlans
from .reader import DcpReader
from .state import ShardedState
from .writer import DcpWriter

logger = logging.getLogger(__name__)


def save(
    checkpointer: AsyncCheckpointer,
    folders: Mapping[str, dict[str, Any]],
    *,
    step: int,
    name: str | None = None,
    files: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    planner: SavePlanner | None = None,
    files_per_rank: int = 1,
    plans: SavePlans | None = None,
    in_order: Iterable[torch.Tensor] = (),
    gated: Iterable[torch.Tensor] = (),
    rank: int | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> SaveHandle:
    """``dcp.save`` of each state dict (DTensors, sharded or plain tensors, objects) into its folder
    (path under the root), all in one commit ``name`` with this rank's ``files``. Every rank calls it,
    as ``dcp.save`` (DCP's collectives run here, on the calling thread). ``plans``: the job's
    ``SavePlans``, to skip planning a save that repeats the last one (only with the default planner).
    ``in_order``, ``gated``: as in ``AsyncCheckpointer.save`` (the model's buffers; its parameters and the
    optimizer's state); ``metadata``: as in ``AsyncCheckpointer.save_files``.

    ``rank``: this process's rank in DCP's group when ``checkpointer`` commits this rank's part alone (the
    local tier's one-rank checkpointer): each folder then gets ``part_metadata(rank)`` instead of rank 0's
    ``.metadata``, and ``writer.merge_parts`` makes that once every part is in one place.

    Returns once this rank's items are in host buffers or queued (call ``handle.wait_snapshot()`` before
    mutating GPU or ``gated`` tensors), with the save's handle: it resolves when every rank's files and
    each folder's ``.metadata`` are committed.
    """
    name = check_name(name if name is not None else layout.default_name(check_step(step)))
    if not folders:
        raise ConfigError(f"air_core.dcp.save(name={name!r}): no folder given.")
    writers = [DcpWriter(checkpointer, folder=f, files_per_rank=files_per_rank, rank=rank) for f in folders]
    for slot, (writer, state) in enumerate(zip(writers, folders.values(), strict=True)):
        if plans is not None and planner is None:
            if plans.replay(slot, writer, state, process_group):
                continue
            dcp.save(state, storage_writer=writer, process_group=process_group)
            plans.remember(slot, writer, process_group)
        else:
            dcp.save(state, storage_writer=writer, process_group=process_group, planner=planner)

    def make(parts: list[PartRecord]) -> dict[str, bytes]:
        return {w.metadata_file: w.make_metadata(parts) for w in writers}

    bundles = {path: bundle for w in writers for path, bundle in w.files.items()}
    finalize = Finalize(tuple(w.metadata_file for w in writers), make)
    return checkpointer.save_files(
        {**bundles, **(files or {})},
        step=step,
        name=name,
        finalize=finalize,
        in_order=in_order,
        gated=gated,
        metadata=metadata,
    )


def load(
    checkpointer: AsyncCheckpointer,
    state_dict: dict[str, Any],
    info: CheckpointInfo,
    *,
    folder: str | None = None,
    process_group: dist.ProcessGroup | None = None,
    planner: LoadPlanner | None = None,
) -> None:
    """``dcp.load`` ``info`` (its DCP folder ``folder``; default: its only one) into ``state_dict`` in
    place, at this run's world size (resharded by DCP).

    Raises:
        torch.distributed.checkpoint.api.CheckpointException: on every rank when any rank failed
            (a damaged file it needed is a ``CorruptCheckpointError`` among the failures).
    """
    dcp.load(
        state_dict,
        storage_reader=DcpReader(checkpointer, info, folder),
        process_group=process_group,
        planner=planner,
    )


def load_newest(
    checkpointer: AsyncCheckpointer,
    state_dict: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    planner: LoadPlanner | None = None,
) -> CheckpointInfo | None:
    """Load the newest committed checkpoint whose needed files verify; None when there is none.

    A damaged file makes every rank's load fail together (DCP gathers failures), so every rank moves
    on to the previous checkpoint together, with a warning that says why.

    Raises:
        CorruptCheckpointError: there are committed checkpoints and none loads.
    """
    committed = [i for i in checkpointer.list() if i.status == "committed"]
    problems = []
    for info in reversed(committed):
        try:
            load(checkpointer, state_dict, info, process_group=process_group, planner=planner)
            return info
        except dcp.api.CheckpointException as exc:
            corrupt = [f for f, _ in exc.failures.values() if isinstance(f, CorruptCheckpointError)]
            if not corrupt:
                raise
            logger.warning("skipping checkpoint %s: %s", info.name, corrupt[0])
            problems.append(f"{info.name}: {corrupt[0].reason}")
    if problems:
        raise CorruptCheckpointError(
            f"no committed checkpoint under {checkpointer.storage.display()} loads: {'; '.join(problems)}",
            path=checkpointer.storage.display(),
            reason="all corrupt",
        )
    return None


def load_into(
    checkpointer: AsyncCheckpointer,
    info: CheckpointInfo,
    target: ShardedState,
    *,
    folder: str | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Every rank: load ``info``'s DCP folder ``folder`` (default: its only one) into ``target``'s model
    and optimizers in place, resharded to this run's world size (``load`` between
    ``target.state_dict()`` and ``target.load_state_dict``)."""
    state = target.state_dict()
    load(checkpointer, state, info, folder=folder, process_group=process_group)
    target.load_state_dict(state)
