"""SIGKILL a real Accelerate loop at each phase of ``save_state``; the relaunch must end bitwise equal.

Each test kills ``tests/accelerate/job.py`` when a chosen save reaches a chosen phase, relaunches the
same command (it resumes through ``accelerator.resume()``), and compares the final weights and the
sample ids and augmentation of every step with an uninterrupted run. The job's dataset adds noise
from the global RNG of whichever process loads the sample (the main process, or a loader worker), so
shuffling, augmentation and dropout all depend on restored RNG state.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.accelerate.runs import run_job, stats, training_args
from tests.sameness import assert_same_run, assert_tier_read_in_place

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of a test's training arguments (``runs.training_args``), run once."""
    cache: dict[tuple[str, ...], Path] = {}

    def get(*args: str) -> Path:
        key = training_args(args)
        if key not in cache:
            cache[key] = tmp_path_factory.mktemp("reference")
            run_job(cache[key], *key)
        return cache[key]

    return get


# Every phase once, loader workers alternating (tests/faults draws phases x workers at random).
@pytest.mark.parametrize(
    ("phase", "workers"),
    [("snapshot_start", "0"), ("serialize_start", "2"), ("upload_start", "0"), ("commit_start", "2")],
)
def test_sigkill_mid_epoch_during_each_save_phase_resumes_exactly(tmp_path, reference, workers, phase):
    args = ("--workers", workers, "--every", "5")
    run_job(tmp_path, *args, "--kill", f"10:{phase}", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(*args))
    (resumed,) = stats(tmp_path)
    assert resumed["restores"][0][0] == "step-000000005", "resumed from the newest committed checkpoint"
    assert resumed["fetches"] == 48 - 5, "fetch_seconds: one per training batch, replayed batches excluded"


@pytest.mark.parametrize("workers", ["0", "2"])
def test_sigkill_between_root_saves_resumes_from_the_local_tier_exactly(tmp_path, reference, workers):
    """Root saves every 10 steps, local ones every 3: killed before step 17, the relaunch resumes from the
    local checkpoint of step 15 (one step lost, not six) and ends bitwise equal."""
    args = ("--workers", workers, "--every", "10", "--local-every", "3")
    run_job(tmp_path, *args, "--die", "17", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(*args))
    (resumed,) = stats(tmp_path)
    assert resumed["restores"][0] == ["local-s000000015-w1", "local"], "the newest local one, read in place"
    assert_tier_read_in_place(tmp_path)


@pytest.mark.parametrize(
    ("loader", "workers"), [("plain", "0"), ("plain", "2"), ("stateful", "2"), ("seedable", "2")]
)
def test_a_local_save_at_an_epoch_boundary_resumes_exactly(tmp_path, reference, loader, workers):
    """The local save of step 16, the last of epoch 0, is taken at the first training fetch after it:
    after the epoch's evaluation pass (``model.eval()``: no local save inside it, whose position and
    RNG no resume replays) and before epoch 1's first batch, whose shuffle the resume draws then too. A
    stateful loader's state there is its own (Accelerate's copy is still the last epoch's)."""
    args = ("--loader", loader, "--workers", workers, "--every", "10", "--local-every", "4")
    run_job(tmp_path, *args, "--die", "18", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(*args))
    (resumed,) = stats(tmp_path)
    assert resumed["restores"][0] == ["local-s000000016-w1", "local"]


@pytest.mark.parametrize(
    ("tier", "interrupt", "restored"),
    [
        (("--local-every", "3"), ("--die", "8"), "local-s000000006-w1"),  # step 7 waited for it
        ((), ("--kill", "10:upload_start"), "step-000000005"),  # step 10 never committed
    ],
    ids=["local-tier", "root"],
)
def test_gradient_accumulation_resumes_exactly_from_an_optimizer_step(
    tmp_path, reference, tier, interrupt, restored
):
    """``gradient_accumulation_steps=2`` with ``accelerator.accumulate(model)``: two batches per optimizer
    step, and a checkpoint (``save_state`` every 5 steps, the local tier every 3) only after an optimizer
    step, never after a batch that only accumulated gradients no checkpoint keeps."""
    args = ("--workers", "2", "--every", "5", "--accumulate", "2", *tier)
    run_job(tmp_path, *args, *interrupt, expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(*args))
    (resumed,) = stats(tmp_path)
    assert resumed["restores"][0][0] == restored, "resumed from the newest committed checkpoint"


# 16 batches per epoch, a save every 4 steps. The first launch is killed in the save of step 20: the
# relaunch resumes from step 16, the save that closed epoch 0. That one is killed in the save of step
# 28: the third resumes from step 24, a checkpoint written after the first resume, mid-epoch 1.
@pytest.mark.parametrize(("loader", "workers"), [("plain", "0"), ("plain", "2"), ("stateful", "0")])
def test_resume_after_an_epoch_closing_checkpoint_and_again_mid_epoch(tmp_path, reference, loader, workers):
    args = ("--loader", loader, "--workers", workers, "--every", "4")
    run_job(tmp_path, *args, "--kill", "20:upload_start", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args, "--kill", "28:serialize_start", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(*args))
    (last,) = stats(tmp_path)  # the kill at 28 waits only for some earlier commit: 24's, or else 20's
    assert last["restores"][0][0] in ("step-000000024", "step-000000020"), "resumed mid-epoch 1"


# The same kills, with two train loaders zipped in one loop. Each shard fetches one batch ahead, the
# first two before the second starts its pass: the second replays its batch fetched ahead of the save
# from the RNG it had then, and must put back the RNG it found (which the first drew from). At the
# save that closed epoch 0, zip stops at the first loader's end and never asks the second for the batch
# after its last, so the second's epoch counter stays (seedable: the same order again) and it is not
# re-entered: its next pass is epoch 1's.
@pytest.mark.parametrize("loader", ["plain", "seedable"])
def test_two_train_loaders_zipped_resume_exactly_at_an_epochs_end_and_mid_epoch(tmp_path, reference, loader):
    args = ("--zip", "--loader", loader, "--every", "4")
    run_job(tmp_path, *args, "--kill", "20:upload_start", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args, "--kill", "28:serialize_start", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(*args))
    (last,) = stats(tmp_path)  # (the first relaunch resumed from 16: the writer commits in order)
    assert last["restores"][0][0] in ("step-000000024", "step-000000020"), "resumed mid-epoch 1"


# Two train loaders one after the other in each epoch (32 steps), a save every 4 steps. Killed in the
# save of 28, the relaunch resumes from 24, inside the second's loop: the loop re-enters epoch 0, where
# the first (its counter moved on) gets no batch. Killed again in the save of 36, the third resumes from
# 32, the second's last batch (or 28): epoch 0 is re-entered for the code after the loops.
def test_two_train_loaders_one_after_the_other_resume_exactly_inside_the_second(tmp_path, reference):
    args = ("--seq", "--every", "4")
    run_job(tmp_path, *args, "--kill", "28:upload_start", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args, "--kill", "36:serialize_start", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(*args))
    (last,) = stats(tmp_path)
    assert last["restores"][0][0] in ("step-000000032", "step-000000028")


@pytest.mark.parametrize(
    ("loader", "workers"),
    [
        ("seedable", "2"),
        ("stateful", "2"),  # augmentation from the loader workers' RNG: their states must be restored
    ],
)
def test_seedable_and_stateful_loaders_resume_exactly_mid_epoch(tmp_path, reference, loader, workers):
    args = ("--loader", loader, "--workers", workers)
    run_job(tmp_path, *args, "--kill", "10:upload_start", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(*args))


# Sent to the job alone, and to its process group with loader workers (as SLURM and Kubernetes send it):
# a forked worker inherits the handler and dies of SIGTERM at once, as in a stock job.
@pytest.mark.parametrize(("workers", "to"), [("0", "job"), ("2", "group")])
def test_sigterm_during_upload_commits_the_inflight_save_then_resumes_exactly(
    tmp_path, reference, workers, to
):
    args = ("--workers", workers, "--every", "5")
    group = ("--sigterm-group",) if to == "group" else ()
    out = run_job(tmp_path, *args, "--sigterm", "10:upload_start", *group, expect_signal=signal.SIGTERM)
    assert "flushed the in-flight checkpoint (SIGTERM)" in out.stderr
    assert (tmp_path / "ckpts/.air/step-000000010/manifest.json").exists(), "the in-flight save committed"
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(*args))


def test_s3_root_on_moto_resumes_exactly(tmp_path, reference, s3_root):
    args = ("--workers", "0", "--every", "5")
    s3 = ("--root", s3_root.url, "--endpoint", s3_root.endpoint)
    run_job(tmp_path, *args, *s3, "--kill", "10:upload_start", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args, *s3)
    assert_same_run(tmp_path, reference(*args))
    assert stats(tmp_path)[0]["restores"][0] == ["step-000000005", "cache"], (
        "the staged copy served the resume"
    )
