"""Elastic resume under Lightning's DDP: a checkpoint of two gloo processes continues on one and on three.

One two-process run commits a checkpoint mid-epoch (step 5 of 8) and finishes its epoch; copies of its
checkpoint folder are resumed with 1 and with 3 processes (``AirCallback(elastic=True)``). Each resumed
run starts from the saved weights, consumes every sample of the interrupted epoch not consumed before
the checkpoint exactly once across its ranks, runs the next epoch at its own world size, and finishes.
"""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch

from lightning_air import latest_checkpoint
from tests.concurrent_jobs import finish, start
from tests.lightning.model import N_SAMPLES
from tests.lightning.test_crash_resume import JOB, run_job
from tests.sameness import records
from tests.zygote import python

pytestmark = pytest.mark.slow
SAVED_STEP = 5  # saves every 5 steps; an epoch is 8 steps on two ranks


def test_a_two_rank_checkpoint_continues_on_one_and_three_ranks_each_sample_once(tmp_path_factory):
    saved = tmp_path_factory.mktemp("two-ranks")
    run_job(saved, "--devices", "2", "--every", str(SAVED_STEP), "--epochs", "1")
    checkpoint = latest_checkpoint(str(saved / "ckpts"))
    assert checkpoint is not None and checkpoint.endswith(f"step={SAVED_STEP}.ckpt"), checkpoint
    weights = torch.load(checkpoint, weights_only=True)["state_dict"]
    before = [
        i for r in range(2) for rec in records(saved, r) if rec["step"] < SAVED_STEP for i in rec["ids"]
    ]

    runs = {}
    for devices in (1, 3):  # both resume from their own copy of the checkpoints, at the same time
        work = tmp_path_factory.mktemp(f"on-{devices}")
        shutil.copytree(saved / "ckpts", work / "ckpts")
        args = ("--devices", str(devices), "--every", str(SAVED_STEP), "--epochs", "2", "--elastic")
        runs[devices] = (work, start([python(), JOB, str(work), *args, "--dump-loaded"], work))
    finish({f"the resume on {n} process(es)": run for n, run in runs.items()})
    for devices, (work, _) in runs.items():
        for rank in range(devices):
            loaded = torch.load(work / f"loaded-rank{rank}.pt", weights_only=True)
            assert all(torch.equal(loaded[k], weights[k]) for k in weights), (
                f"rank {rank} loaded the saved weights"
            )
        seen = [records(work, rank) for rank in range(devices)]
        assert min(rec["step"] for rank in seen for rec in rank) == SAVED_STEP, "resumed at the saved step"
        rest = [i for rank in seen for rec in rank if rec["epoch"] == 0 for i in rec["ids"]]
        assert Counter(before + rest) == Counter(range(N_SAMPLES)), (
            f"on {devices} rank(s): every sample of the interrupted epoch exactly once"
        )
        per_rank = {len([rec for rec in rank if rec["epoch"] == 0]) for rank in seen}
        assert len(per_rank) == 1, f"every rank ran as many steps of the interrupted epoch: {per_rank}"
        next_epoch = [i for rank in seen for rec in rank if rec["epoch"] == 1 for i in rec["ids"]]
        padded = -(-N_SAMPLES // devices) * devices  # DistributedSampler pads to equal shares
        assert set(next_epoch) == set(range(N_SAMPLES)) and len(next_epoch) == padded, (
            "the next epoch is whole"
        )
        assert (work / "final.pt").exists(), "training completed"
