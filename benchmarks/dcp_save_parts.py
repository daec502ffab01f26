"""Where the blocking time of one ``air_core.dcp.save`` goes: ``get_state_dict``, planning (``dcp.save``
with our writer: DCP's planning and collectives, the writer itself only collects references), and the
snapshot copy into host buffers. Three ways of planning take turns in one job: every save planned by
``dcp.save``, DCP's plan caching, and ``air_core.dcp.SavePlans`` (the last plan replayed after one
all-reduce, what ``TrainingSession`` uses).

Run under torchrun, one process per rank (gloo on CPU), on the model of ``benchmarks/sharded_save.py``:

    torchrun --standalone --nproc-per-node 4 benchmarks/dcp_save_parts.py --size-mib 1024

Rank 0 prints, per setting, the median over saves of the slowest rank's seconds in each part.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402
from sharded_save import build  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

from air_core import AsyncCheckpointer, PhaseEvent  # noqa: E402
from air_core import dcp as air_dcp  # noqa: E402

PARTS = ("get_state_dict", "planning", "snapshot", "blocking")
SETTINGS = ("dcp.save", "DCP plan caching", "SavePlans")


class SnapshotStart:
    """When this rank's snapshot copy began (``perf_counter``): the end of ``dcp.save``."""

    def __init__(self) -> None:
        self.at = 0.0

    def on_event(self, event: Any) -> None:
        if isinstance(event, PhaseEvent) and event.phase == "snapshot_start":
            self.at = time.perf_counter()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024, help="model + AdamW state over all ranks")
    p.add_argument("--saves", type=int, default=6, help="timed saves per setting (after one warm-up each)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, step = build(args.size_mib, "cpu", rank)
    root = [tempfile.mkdtemp(prefix="air-dcp-parts-") if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    mark = SnapshotStart()
    ckpt = AsyncCheckpointer(
        root[0], rank=rank, world_size=world, launch_id="dcp-save-parts", keep_last=2, listeners=[mark]
    )
    times: dict[str, list[list[float]]] = {setting: [] for setting in SETTINGS}
    plans = air_dcp.SavePlans()
    for i in range(args.saves + 1):
        for k, setting in enumerate(SETTINGS):
            step()
            dist.barrier()
            t0 = time.perf_counter()
            model_sd, optim_sd = get_state_dict(model, opt)
            t1 = time.perf_counter()
            handle = air_dcp.save(
                ckpt,
                {"ckpt": {"state_dict": model_sd, "optimizer_0": optim_sd}},
                step=len(SETTINGS) * i + k + 1,
                planner=DefaultSavePlanner(enable_plan_caching=True) if k == 1 else None,
                plans=plans if k == 2 else None,
            )
            t3 = time.perf_counter()
            if i:  # the first round warms up (allocations, the plan caches)
                times[setting].append([t1 - t0, mark.at - t1, t3 - mark.at, t3 - t0])
            handle.result(timeout=600)
    assert plans.replayed == args.saves, plans.replayed  # every save after the first one
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, times)
    if rank == 0:
        print(f"{world} ranks, {args.size_mib} MiB, {args.saves} saves per setting; seconds, max over ranks")
        print(f"{'planned by':<18}" + "".join(f"{part:>16}" for part in PARTS))
        for setting in SETTINGS:
            rows = [[max(g[setting][s][k] for g in gathered) for k in range(4)] for s in range(args.saves)]
            medians = [statistics.median(row[k] for row in rows) for k in range(4)]
            print(f"{setting:<18}" + "".join(f"{m:>16.4f}" for m in medians))
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
