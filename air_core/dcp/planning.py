"""``SavePlans``: a sharded save whose plan repeats on every rank skips ``dcp.save``'s exchanges.

A job saves the same model again and again, and DCP plans each save anew: four object collectives
(plans gathered and scattered, write results gathered, the outcome broadcast), where waiting for the
slowest rank dominates the blocking time on a busy host. ``SavePlans`` keeps each rank's last plan: a
save whose plan repeats on every rank (agreed in one all-reduce) reuses the last global plan and
metadata; any difference on any rank plans in full.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from .writer import DcpWriter, Planned


class SavePlans:
    """Each rank's last plan of a job's sharded saves, by the folder's position in a ``save`` call and
    the process group (its ranks) the save ran on.

    Pass one instance to every ``save`` of a job (``TrainingSession`` does). A save plans locally; one
    all-reduce tells whether every rank's plan is the one it made last time. If so, the last global plan
    and metadata are reused and ``dcp.save``'s exchanges are skipped; otherwise (the first save, a key
    added, a shape changed, on any rank) ``dcp.save`` plans in full and its plans are kept.
    """

    def __init__(self) -> None:
        self._planned: dict[tuple[int, tuple[int, ...]], Planned] = {}
        self.replayed = 0
        """How many folders were saved with a repeated plan (no ``dcp.save`` exchanges)."""

    def replay(
        self, slot: int, writer: DcpWriter, state: dict[str, Any], process_group: dist.ProcessGroup | None
    ) -> bool:
        """Every rank: collect ``state`` into ``writer`` with the last plan of ``slot`` if it repeats on
        every rank (True); False if ``dcp.save`` must plan it (every rank gets the same answer)."""
        coordinator = writer.coordinator
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, writer.storage_meta(), coordinator)
        local = planner.create_local_plan()
        last = self._planned.get(_key(slot, process_group))
        same = _repeats(local, writer, last)
        if _distributed():
            agreed = torch.tensor([int(same)], dtype=torch.int32)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=process_group)
            same = bool(agreed.item())
        if not same:
            return False
        assert last is not None
        writer.write_data(planner.finish_plan(last.final), planner)
        if coordinator:
            assert last.metadata is not None
            writer.finish(last.metadata, last.results)
        self.replayed += 1
        return True

    def remember(self, slot: int, writer: DcpWriter, process_group: dist.ProcessGroup | None) -> None:
        """After ``dcp.save`` with ``writer`` returned on every rank: keep the plans it made."""
        self._planned[_key(slot, process_group)] = writer.planned()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _key(slot: int, process_group: dist.ProcessGroup | None) -> tuple[int, tuple[int, ...]]:
    """A folder's position in a save, on a process group (its global ranks: a plan repeats on one group)."""
    if not _distributed():
        return slot, ()
    return slot, tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))


def _repeats(plan: SavePlan, writer: DcpWriter, last: Planned | None) -> bool:
    """Whether ``plan`` writes the items of ``last`` (names, chunks, dtypes), flattened as they were and
    bundled into the same files (the results name them)."""
    return (
        last is not None
        and plan.items == last.local.items
        and plan.planner_data == last.local.planner_data
        and writer.files_per_rank == last.files_per_rank
    )
