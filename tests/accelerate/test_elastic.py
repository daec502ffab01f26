"""Elastic resume under Accelerate: a checkpoint of two gloo processes continues on one and on three.

One two-process run (``accelerate launch``) commits ``step-5`` mid-epoch (8 steps an epoch) and finishes
its epoch; copies of its root are resumed with 1 and with 3 processes (``AirPlugin(elastic=True)``).
Each resumed run starts from the saved weights, consumes every sample of the interrupted epoch not
consumed before the checkpoint exactly once across its processes, runs the next epoch at its own
world size (Accelerate's even batches repeat a few samples there), and finishes.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.accelerate.job import N_SAMPLES
from tests.accelerate.runs import JOB, LAUNCH_ARGS, run_job
from tests.concurrent_jobs import finish, start
from tests.sameness import records
from tests.zygote import python

pytestmark = pytest.mark.slow
SAVED_STEP = 5


def _command(workdir: Path, processes: int, *args: str) -> list[str]:
    """``job.py`` on ``processes`` processes (``accelerate launch``; one: a plain interpreter)."""
    launch = [python()]
    if processes > 1:
        launch += LAUNCH_ARGS
        launch[launch.index("--num_processes") + 1] = str(processes)
    return [*launch, JOB, str(workdir), *args]


def test_a_two_process_checkpoint_continues_on_one_and_three_processes_each_sample_once(tmp_path_factory):
    saved = tmp_path_factory.mktemp("two-processes")
    run_job(saved, "--every", str(SAVED_STEP), "--epochs", "1", processes=2)
    assert sorted(p.name for p in (saved / "ckpts").glob("step-*")) == [f"step-{SAVED_STEP:09d}"]
    weights = load_file(saved / f"ckpts/step-{SAVED_STEP:09d}/model.safetensors")
    before = [
        i for r in range(2) for rec in records(saved, r) if rec["step"] < SAVED_STEP for i in rec["ids"]
    ]
    runs = {}
    for processes in (1, 3):  # both resume from their own copy of the root, at the same time
        work = tmp_path_factory.mktemp(f"on-{processes}")
        shutil.copytree(saved / "ckpts", work / "ckpts")
        args = ("--every", str(SAVED_STEP), "--epochs", "2", "--elastic", "--dump-loaded")
        runs[processes] = (work, start(_command(work, processes, *args), work))
    finish({f"the resume on {n} process(es)": run for n, run in runs.items()})
    for processes, (work, _) in runs.items():
        for rank in range(processes):
            loaded = torch.load(work / f"loaded-rank{rank}.pt", weights_only=True)
            assert all(torch.equal(loaded[k], weights[k]) for k in weights), (
                f"process {rank} resumed with the saved weights"
            )
        seen = [records(work, rank) for rank in range(processes)]
        assert min(rec["step"] for rank in seen for rec in rank) == SAVED_STEP, "resumed at the saved step"
        rest = [i for rank in seen for rec in rank if rec["epoch"] == 0 for i in rec["ids"]]
        assert Counter(before + rest) == Counter(range(N_SAMPLES)), (
            f"on {processes} process(es): every sample of the interrupted epoch exactly once"
        )
        per_rank = {len([rec for rec in rank if rec["epoch"] == 0]) for rank in seen}
        assert len(per_rank) == 1, f"every process ran as many steps of the interrupted epoch: {per_rank}"
        next_epoch = [i for rank in seen for rec in rank if rec["epoch"] == 1 for i in rec["ids"]]
        assert set(next_epoch) == set(range(N_SAMPLES)), "the next epoch is whole"
        assert (work / "final.pt").exists(), "training completed"
