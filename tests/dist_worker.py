"""One rank of a 2-process gloo job that saves through AsyncCheckpointer (run as a script by tests).

Usage: python tests/dist_worker.py RANK WORLD ROOT INIT_FILE SCENARIO
SCENARIO: ``ok`` (two saves), ``slow`` (rank 1 uploads its part late), ``die`` (rank 1 is SIGKILLed before its
part of the second save), ``die0`` (rank 0 is SIGKILLed as it commits the second save: rank 1 has its part
written), ``witness`` (as ``die``, every rank given the ``peers``: run with rank 1 and another rank on one
"node" and rank 0 on another, ``AIR_NODE_NAME``; rank 1's beacon unreachable from rank 0), ``far``/``far0``
(as ``die``/``die0``, every rank given the ``peers``: run with each rank on a "node" of its own),
``fail0``/``fail1`` (rank 0's or rank 1's part of the second save fails: a folder stands where its file goes;
then both save it again, without it).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import time
import uuid

import torch
import torch.distributed as dist

from air_core import AsyncCheckpointer, PhaseEvent, commit, procfs


def rank_state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"rank": rank, "step": step, "w": torch.randn(64, 64, generator=g)}


class Fault:
    def __init__(self, rank: int, scenario: str) -> None:
        self.rank, self.scenario = rank, scenario

    def on_event(self, event) -> None:
        if not isinstance(event, PhaseEvent):
            return
        committing = event.phase == "commit_start" and event.step == 2
        if self.scenario in ("die0", "far0") and self.rank == 0 and committing:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.rank != 1 or event.phase != "serialize_start":
            return
        if self.scenario == "slow":
            time.sleep(1.0)
        if self.scenario in ("die", "witness", "far") and event.step == 2:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    rank, world, root, init_file, scenario = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    launch = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(launch, src=0)  # on the training thread, as the adapters do
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    peers: tuple[procfs.Process, ...] = ()
    if scenario in ("witness", "far", "far0"):  # as a session gathers them

        def gather(mine: procfs.Process) -> list[procfs.Process]:
            if scenario == "witness" and rank == 1:  # rank 0 cannot reach its beacon: only its host sees it
                mine = dataclasses.replace(mine, beacon="127.0.0.1:1")
            every = [None] * world
            dist.all_gather_object(every, mine)
            return every

        peers = commit.gather_peers(rank, world, gather)
    ckpt = AsyncCheckpointer(
        root,
        rank=rank,
        world_size=world,
        launch_id=launch[0],
        peers=peers,
        keep_last=5,
        commit_timeout_seconds=120.0,  # a failed or dead peer is known sooner (waits take under 60 s)
        listeners=[Fault(rank, scenario)],
    )
    info = ckpt.save(rank_state(rank, 1), step=1).result(timeout=60)
    print(f"rank {rank} committed step 1 with {len(info.manifest.files)} files", flush=True)
    if scenario == f"fail{rank}":
        os.makedirs(os.path.join(root, "step-000000002", f"rank-{rank:05d}.pt", "in-the-way"))
    try:
        ckpt.save(rank_state(rank, 2), step=2).result(timeout=60)
        print(f"rank {rank} committed step 2", flush=True)
    except Exception as exc:
        print(f"rank {rank} step 2 failed: {type(exc).__name__}: {exc}", flush=True)
    if scenario.startswith("fail"):  # the same save again, the obstacle gone: its second attempt
        if scenario == f"fail{rank}":
            shutil.rmtree(os.path.join(root, "step-000000002", f"rank-{rank:05d}.pt"))
        ckpt.save(rank_state(rank, 2), step=2).result(timeout=60)
        print(f"rank {rank} committed step 2 at the second attempt", flush=True)
    ckpt.close()


if __name__ == "__main__":
    main()
