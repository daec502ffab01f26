"""Two gloo processes under Lightning's DDP: per-rank exact resume, and a rank lost before the commit."""

from __future__ import annotations

import pytest

from lightning_air import latest_checkpoint
from tests.lightning.test_crash_resume import run_job
from tests.sameness import assert_same_run

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
