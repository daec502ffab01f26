"""Two gloo processes under Lightning's DDP: per-rank exact resume, and a rank lost before the commit."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pytest

from lightning_air import latest_checkpoint
from tests.conftest import REPO
from tests.faults.trials import running_ranks
from tests.lightning.test_crash_resume import JOB, run_job
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
    proc = subprocess.Popen(
        [python(), JOB, str(tmp_path), *DDP, "--kill", "10:upload_start:1", "--commit-timeout", "5"],
        env={**os.environ, "PYTHONPATH": REPO},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        seen_two = False
        while time.monotonic() < deadline and proc.poll() is None:
            ranks = running_ranks(tmp_path)
            seen_two |= ranks >= 2
            if seen_two and ranks < 2:
                break  # rank 1 is gone; give rank 0 time to give up on its part
            time.sleep(0.2)
        time.sleep(8)
    finally:
        with contextlib.suppress(ProcessLookupError):  # Lightning may have ended the job itself
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert seen_two, "the job must have run two ranks"
    newest = latest_checkpoint(str(tmp_path / "ckpts"))
    assert newest is not None and newest.endswith("step=5.ckpt"), f"step 10 must not commit: {newest}"
