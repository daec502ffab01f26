"""Two gloo processes under Lightning's DDP: per-rank exact resume, a rank lost before the commit, and
folds fitted one after another."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lightning_air import latest_checkpoint
from tests.conftest import REPO
from tests.held import assert_no_more_held
from tests.lightning.test_crash_resume import run_job
from tests.sameness import assert_same_run
from tests.zygote import python

pytestmark = pytest.mark.slow
DDP = ["--devices", "2", "--every", "5"]


def test_ddp_crash_of_both_ranks_resumes_exactly_per_rank(tmp_path_factory):
    reference = tmp_path_factory.mktemp("ddp-reference")
    run_job(reference, *DDP, "--epochs", "2")
    resumed = tmp_path_factory.mktemp("ddp-resumed")
    run_job(resumed, *DDP, "--epochs", "2", "--kill", "10:upload_start", expect_kill=True)
    run_job(resumed, *DDP, "--epochs", "2")
    assert_same_run(resumed, reference, ranks=2)


def test_rank_killed_before_commit_leaves_previous_checkpoint_newest(tmp_path):
    """Rank 1 killed before its part of step 10: rank 0 stops waiting for that part (it sees the process
    gone), and the job ends by itself; step 10 never commits."""
    run_job(tmp_path, *DDP, "--kill", "10:upload_start:1", lost_peer=True)
    newest = latest_checkpoint(str(tmp_path / "ckpts"))
    assert newest is not None and newest.endswith("step=5.ckpt"), f"step 10 must not commit: {newest}"


def test_folds_fitted_one_after_another_in_the_same_processes_hold_no_more_files_or_threads(tmp_path):
    """A ``Trainer`` per fold in the same DDP processes: every fold's session reuses the gloo group its
    local tier talks on (``side_groups.py``); making one per fold cost each rank 5 files and 3 threads
    more at every fold."""
    out = subprocess.run(
        [python(), str(Path(__file__).with_name("folds.py")), str(tmp_path), "4"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert_no_more_held(out.stdout, "fold", 4)
