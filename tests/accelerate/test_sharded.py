"""``AirAccelerator`` with Accelerate's FSDP2 plugin (sharded state dicts) and a real ``prepare``,
``save_state``, ``load_state`` and ``resume()``, on gloo processes: Accelerate keeps FSDP off on CPU, so
the job turns it back on for itself (tests/accelerate/fsdp_on_cpu.py). The GPU run is in
benchmarks/gpu_check.sh.

A save killed while one rank writes its shards resumes bitwise equal to an uninterrupted run; a
checkpoint of two processes continues on one and on three with the full model and optimizer state as
saved and every sample of the interrupted epoch once; the committed folder loads with stock Accelerate's
``load_state``, and its model folder with stock DCP.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.accelerate.job import N_SAMPLES
from tests.accelerate.runs import JOB, run_job, stats
from tests.concurrent_jobs import finish, start
from tests.conftest import REPO
from tests.sameness import assert_same_run, assert_same_state, assert_tier_read_in_place, records
from tests.torchrun_nodes import lose_node_b, restored_on_c
from tests.zygote import python

pytestmark = pytest.mark.slow
SAVED_STEP = 5
ARGS = ("--fsdp2", "--epochs", "1")
STOCK_LOAD = os.path.join(REPO, "tests/accelerate/stock_fsdp2_load.py")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One epoch (8 steps) on two processes, saving at step 5: mid-epoch, with 24 samples left (whole
    batches at 1 and at 3 processes, so no padding repeats one)."""
    workdir = tmp_path_factory.mktemp("fsdp2-two-processes")
    run_job(workdir, *ARGS, "--every", str(SAVED_STEP), processes=2)
    return workdir


def test_fsdp2_saves_killed_while_a_rank_writes_resume_exactly(saved, tmp_path):
    """Saves every 3 steps; rank 1 killed while writing step 6: the resume from step 3 is the
    uninterrupted run (``saved``: when a job saves does not change what it trains)."""
    args = (*ARGS, "--every", "3")
    run_job(tmp_path, *args, "--kill", "6:serialize_start:1", processes=2, expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args, processes=2)
    assert_same_run(tmp_path, saved, ranks=2)
    resume = stats(tmp_path)[0]
    assert resume["restores"] == [["step-000000003", "cache"]], "one restore: every folder and file it read"


def test_fsdp2_killed_between_root_saves_resumes_from_its_local_tier_exactly(saved, tmp_path):
    """Root saves every 5 steps, local ones every 2: both ranks killed at once before step 8 resume from
    step 6, assembled from each rank's own shards and a ``.metadata`` merged from their shares."""
    args = (*ARGS, "--every", "5", "--local-every", "2")
    run_job(tmp_path, *args, "--die", "8", processes=2, expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args, processes=2)
    assert_same_run(tmp_path, saved, ranks=2)
    assert stats(tmp_path)[0]["restores"][0] == ["local-s000000006-w2", "local"], "the local tier's step 6"
    assert_tier_read_in_place(tmp_path)


def test_a_replaced_node_gets_its_shards_from_the_partner_and_resumes_exactly(saved, tmp_path):
    """Nodes A and B (torchrun agents, a job of fixed size, one process each), local saves every 2
    steps: B (agent and process) is lost before step 8, and node C joins with an empty local folder. Step
    6 is A's own part and A's copy of B's: C is sent both without their shards, and its load brings the
    shard files its plan reads from A (its own, never rank 0's). The run is the uninterrupted one."""
    args = (*ARGS, "--every", "5", "--local-every", "2", "--die", "8:B:agent")
    logs = lose_node_b(JOB, tmp_path, *args, min_nodes=2, replace_when=lambda agent: agent.poll() is not None)
    log = logs["A"] + logs["C"]
    assert "resuming from local tier step 6 (replica)" in log, log[-4000:]
    assert "from node A, rank 1: from node A" in log, "the new node's parts came from A"
    assert_same_run(tmp_path, saved, ranks=2)
    rank, restored = restored_on_c(tmp_path)
    folders = sorted(restored.glob("step-6/*_0"))  # the model's, the optimizer's
    assert len(folders) == 2, folders
    for folder in folders:  # __<rank>_0: a rank's shards; __<rank>_1: the whole items DCP gave it
        on_c = sorted(p.name for p in folder.glob("__*.distcp"))
        assert f"__{rank}_0.distcp" in on_c and f"__{1 - rank}_0.distcp" not in on_c, f"C's own: {on_c}"


def test_a_two_process_fsdp2_checkpoint_continues_on_one_and_three_processes(saved, tmp_path_factory):
    full = torch.load(saved / f"saved-{SAVED_STEP}.pt", weights_only=False)
    folder = saved / f"ckpts/step-{SAVED_STEP:09d}"
    # Accelerate's stock load_fsdp_model reads the model folder with DCP's FileSystemReader.
    state = {"model": {k: torch.zeros_like(v) for k, v in full["model"].items()}}
    dcp.load(state, storage_reader=FileSystemReader(str(folder / "pytorch_model_fsdp_0")), no_dist=True)
    assert_same_state(full["model"], state["model"], "read by stock DCP")
    before = [
        i for r in range(2) for rec in records(saved, r) if rec["step"] < SAVED_STEP for i in rec["ids"]
    ]
    runs = {}
    for processes in (1, 3):  # torchrun, as `accelerate launch --multi_gpu` starts them (it refuses one)
        work = tmp_path_factory.mktemp(f"fsdp2-on-{processes}")
        shutil.copytree(saved / "ckpts", work / "ckpts")
        command = [*_torchrun(processes), JOB, str(work), "--fsdp2", "--every", str(SAVED_STEP)]
        runs[processes] = (work, start([*command, "--epochs", "2", "--elastic", "--dump-loaded"], work))
    stock = tmp_path_factory.mktemp("fsdp2-stock-load")  # the folder as it is, by stock load_state
    command = [*_torchrun(2), STOCK_LOAD, str(folder), str(stock / "loaded.pt")]
    finish(
        {
            **{f"the FSDP2 resume on {n} process(es)": run for n, run in runs.items()},
            "stock Accelerate's load_state": (stock, start(command, stock)),
        }
    )
    assert_same_state(full, torch.load(stock / "loaded.pt", weights_only=False), "by stock load_state")
    for processes, (work, _) in runs.items():
        loaded = torch.load(work / "loaded.pt", weights_only=False)
        assert_same_state(full, loaded, f"(model and optimizer) resharded to {processes} process(es)")
        seen = [records(work, rank) for rank in range(processes)]
        assert min(rec["step"] for rank in seen for rec in rank) == SAVED_STEP, "resumed at the saved step"
        rest = [i for rank in seen for rec in rank if rec["epoch"] == 0 for i in rec["ids"]]
        assert Counter(before + rest) == Counter(range(N_SAMPLES)), (
            f"on {processes} process(es): every sample of the interrupted epoch exactly once"
        )
        assert (work / "final.pt").exists(), "training completed"


def _torchrun(processes: int) -> list[str]:
    return [python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
