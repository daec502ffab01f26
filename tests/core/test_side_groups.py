"""``side_groups``: the gloo groups a session talks on beside training's, and the room they need among a
process's open files (two gloo processes; their reuse across sessions is tested with the stop vote in
``test_stop_vote.py`` and with Lightning's folds in ``tests/lightning/test_ddp.py``)."""

from __future__ import annotations

import json
import os
import resource

import torch.distributed as dist

from air_core import ConfigError, side_groups
from tests.conftest import spawn_ranks
from tests.torchrun_nodes import free_port


def _take_worker(rank: int, port: int, folder: str, hard_on_rank_1: bool) -> None:
    """Each rank lowers its soft limit on open files to a few more than it holds (rank 1 its hard
    limit too, with ``hard_on_rank_1``), then takes both groups; writes what came of it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    held = len(os.listdir("/proc/self/fd"))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = held + 8  # a group takes 5 here; both, with the headroom, need far more
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, low if hard_on_rank_1 and rank == 1 else hard))
    try:
        groups = side_groups.take([side_groups.TIER, side_groups.VOTE], 30)
        dist.barrier(group=groups[side_groups.VOTE])  # the group works
        outcome = {"soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "low": low}
    except ConfigError as exc:
        outcome = {"error": str(exc)}
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    dist.destroy_process_group()


def _outcomes(tmp_path, hard_on_rank_1: bool) -> list[dict]:
    spawn_ranks(_take_worker, args=(free_port(), str(tmp_path), hard_on_rank_1), nprocs=2, timeout=120)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_soft_limit_on_open_files_too_low_for_the_groups_is_raised_up_to_the_hard_one(tmp_path):
    for outcome in _outcomes(tmp_path, hard_on_rank_1=False):
        assert "error" not in outcome, outcome
        assert outcome["soft"] > outcome["low"], outcome


def test_a_rank_whose_hard_limit_leaves_no_room_fails_every_rank_at_once_naming_it(tmp_path):
    """Not rank 1 failing inside gloo's connect while rank 0 waits on it until the group's timeout."""
    for outcome in _outcomes(tmp_path, hard_on_rank_1=True):
        error = outcome.get("error", "")
        assert "rank 1: " in error and "rank 0: " not in error and "ulimit -n" in error, outcome
