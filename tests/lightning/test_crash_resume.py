"""SIGKILL a real Trainer at each phase of a save; the relaunched command must end bitwise equal.

Each test kills ``tests/lightning/job.py`` when a chosen save reaches a chosen phase, relaunches the
same command (it resumes through ``latest_checkpoint``), and compares the final weights and the
sample ids and augmentation of every step with an uninterrupted run of the same job. The job's map-style
dataset adds noise from the global RNG of whichever process loads the sample (the main process, or a
loader worker), so shuffling, augmentation and dropout all depend on restored RNG state.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from air_core import AsyncCheckpointer
from tests import stalls
from tests.conftest import REPO
from tests.sameness import assert_same_run, assert_tier_read_in_place, records, resumed_at
from tests.zygote import python

pytestmark = pytest.mark.slow
JOB = os.path.join(REPO, "tests/lightning/job.py")


def run_job(
    workdir: Path, *args: str, expect_kill: bool = False, lost_peer: bool = False, job: str = JOB
) -> subprocess.CompletedProcess[str]:
    """Run a Lightning test job script (default tests/lightning/job.py) to completion or to its SIGKILL.

    ``lost_peer``: a rank other than 0 is killed. Rank 0 (the script, Lightning's launcher) then fails on
    the lost peer (exit 1), unless the launcher, which kills every rank once one died, kills it first."""
    out = subprocess.run(
        [python(), job, str(workdir), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    shown = stalls.shown(workdir, args, out)
    if lost_peer:
        assert out.returncode in (1, -9), f"expected a failure on the lost rank {shown}"
    elif expect_kill:
        assert out.returncode == -9, f"expected a SIGKILL {shown}"
    else:
        assert out.returncode == 0, f"job failed {shown}"
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache: dict[tuple[object, ...], Path] = {}

    def get(
        workers: int, *training: str, loader: str = "plain", accumulate: int = 1, val_every: int = 0
    ) -> Path:
        """The uninterrupted run of those settings; ``training``: more of the job's arguments that change
        what it trains (never its saves)."""
        key = (workers, loader, accumulate, val_every, *training)
        if key not in cache:
            cache[key] = tmp_path_factory.mktemp(f"reference-w{workers}-{loader}-a{accumulate}-v{val_every}")
            settings = ("--workers", str(workers), "--loader", loader, "--accumulate", str(accumulate))
            run_job(cache[key], *settings, "--val-every", str(val_every), *training)
        return cache[key]

    return get


# Every phase once, loader workers alternating (tests/faults draws phases x workers at random).
@pytest.mark.parametrize(
    ("phase", "workers"),
    [("snapshot_start", 0), ("serialize_start", 2), ("upload_start", 0), ("commit_start", 2)],
)
def test_sigkill_mid_epoch_during_each_save_phase_resumes_exactly(tmp_path, reference, workers, phase):
    args = ["--workers", str(workers), "--every", "5"]
    run_job(tmp_path, *args, "--kill", f"10:{phase}", expect_kill=True)
    resumed = run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(workers))
    # Lightning's warning that a plain loader cannot continue its epoch is false here: it does.
    assert "your dataloader is not resumable" not in resumed.stderr, resumed.stderr[-3000:]


def test_sigkill_between_root_saves_resumes_from_the_local_tier_exactly(tmp_path, reference):
    """``ModelCheckpoint`` every 10 steps, ``AirCallback(local_every_n_steps=3)``, ``ckpt_path=NEWEST``: the
    first launch starts fresh through it, is killed at once before step 18, and the relaunch resumes from
    the local checkpoint of step 15 (step 17's optimizer step waited for it), bitwise equal."""
    args = ["--workers", "2", "--every", "10", "--local-every", "3"]
    run_job(tmp_path, *args, "--die", "18", expect_kill=True)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(2))
    resumed = resumed_at(tmp_path)
    assert resumed == 15, f"resumed from the newest local checkpoint, not the root's step 10: {resumed}"
    assert_tier_read_in_place(tmp_path)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_local_save_at_an_epoch_boundary_resumes_exactly(tmp_path, reference, workers):
    """The local save of step 16, the last of epoch 0, is taken before epoch 1's first fetch; the resume
    draws that epoch's shuffle seed at its first fetch, as the run did after the save (``num_workers=0``:
    the augmentation drawn on the training thread comes after it)."""
    args = ["--workers", str(workers), "--every", "10", "--local-every", "4"]
    run_job(tmp_path, *args, "--die", "18", expect_kill=True)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(workers))
    resumed = resumed_at(tmp_path)
    assert resumed == 16, f"resumed from the local save of step 16: {resumed}"


@pytest.mark.parametrize(
    ("saves", "die", "expected"),
    [
        (("--every", "5"), "12", (5, 10)),  # ModelCheckpoint's of step 10 (or 5), before the validation
        (("--every", "10", "--local-every", "5"), "17", (15,)),  # the local tier's of step 15, after it
    ],
    ids=["root", "local-tier"],
)
def test_a_resume_at_a_step_with_a_validation_is_exact(tmp_path, reference, saves, die, expected):
    """``val_check_interval=5``: a validation after every fifth step, drawing from the RNG (its shuffled
    loader's base seed and its step). Lightning resumes a checkpoint saved at such a step's
    ``on_train_batch_end`` past its validation, which the run it resumes did run: so a validation inside
    a fit draws from a copy of the RNG (``AirCallback``, as Lightning's sanity check does)."""
    args = ["--workers", "0", "--val-every", "5", *saves]
    run_job(tmp_path, *args, "--die", die, expect_kill=True)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(0, val_every=5))
    resumed = resumed_at(tmp_path)
    assert resumed in expected, f"resumed at step {resumed}"


@pytest.mark.parametrize(
    ("tier", "interrupt"),
    [
        ((), ("--kill", "32:upload_start")),  # epoch 1's save never commits: epoch 0's is the newest
        (("--local-every", "4"), ("--die", "19")),  # the local tier's step 16 (step 19 waited for it)
    ],
    ids=["root", "local-tier"],
)
def test_a_resume_from_an_epoch_end_checkpoint_taken_after_the_validation_is_exact(
    tmp_path, reference, tier, interrupt
):
    """``ModelCheckpoint()`` as Lightning's docs show it: once per epoch, after the validation at the
    epoch's end (``on_validation_end``). The resume starts the next epoch where the run it resumes
    started it: with that validation's draws undone as they were there (``AirCallback``)."""
    args = ["--workers", "2", "--every", "0", "--val-epoch", *tier]
    run_job(tmp_path, *args, *interrupt, expect_kill=True)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(2, "--val-epoch"))
    resumed = resumed_at(tmp_path)
    assert resumed == 16, f"resumed at step {resumed}"


@pytest.mark.parametrize(
    ("workers", "tier", "interrupt"),
    [
        (0, ("--every", "5"), ("--kill", "15:upload_start")),  # the root's step 10, the epoch's last
        (2, ("--every", "100", "--local-every", "5"), ("--die", "13")),  # the local tier's step 10
    ],
    ids=["root", "local-tier"],
)
def test_an_epoch_cut_short_by_limit_train_batches_resumes_into_the_next_epoch(
    tmp_path, reference, workers, tier, interrupt
):
    """``Trainer(limit_train_batches=10)`` ends each epoch after 10 of the loader's 16 batches, its pass
    unfinished. A resume from the checkpoint at such an epoch's end starts the next epoch's pass (a new
    order, none of it skipped), not the rest of the cut one."""
    args = ["--workers", str(workers), "--limit", "10", *tier]
    run_job(tmp_path, *args, *interrupt, expect_kill=True)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(workers, "--limit", "10"))
    resumed = resumed_at(tmp_path)
    assert resumed == 10, f"resumed at step {resumed}"


@pytest.mark.parametrize(
    ("tier", "interrupt", "optimizer_step"),
    [
        (("--local-every", "3"), ("--die", "8"), 6),  # the local tier's step 6 (step 7 waited for it)
        ((), ("--kill", "10:upload_start"), 5),  # the root's step 5: step 10 never committed
    ],
    ids=["local-tier", "root"],
)
def test_gradient_accumulation_resumes_exactly_from_an_optimizer_step(
    tmp_path, reference, tier, interrupt, optimizer_step
):
    """``Trainer(accumulate_grad_batches=2)``: two batches per optimizer step, and a checkpoint (the
    root's every 5 steps, the local tier's every 3) only after an optimizer step, whose gradients it
    need not hold. A local save after every batch of a step (each accumulates into gradients no
    checkpoint keeps) would resume past batches whose gradients were lost; the second one of a name
    failed the fit."""
    args = ["--workers", "2", "--every", "5", "--accumulate", "2", *tier]
    run_job(tmp_path, *args, *interrupt, expect_kill=True)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(2, accumulate=2))
    resumed = resumed_at(tmp_path, "step", "optimizer_step")
    assert resumed == (2 * optimizer_step, optimizer_step), f"resumed at (batch, optimizer step) {resumed}"


@pytest.mark.parametrize(
    ("loader", "workers", "saves", "kill", "expected"),
    [
        ("plain", 2, "5", "25:upload_start", 20),  # mid-epoch 1, in the loader built for it
        ("iterable", 0, "5", "25:upload_start", 20),  # a torchdata loader's state at the epoch's start
        ("stateful", 0, "16", "48:upload_start", 32),  # epoch 1's end: epoch 2's loader is built anew
    ],
    ids=["plain-mid-epoch", "iterable-mid-epoch", "stateful-epoch-end"],
)
def test_loaders_built_again_every_epoch_resume_exactly(
    tmp_path, reference, loader, workers, saves, kill, expected
):
    """``Trainer(reload_dataloaders_every_n_epochs=1)``: each epoch's train loader is built anew (a
    curriculum's pattern). A checkpoint holds the position of the loader the fit iterates, not of every
    loader the run built, so a resume, which builds one, continues it. At an epoch's start Lightning
    starts a pass of the new loader, then another: the epoch-start state of a torchdata loader is the
    second pass's. From an epoch's end the RNG goes back before the next epoch's loader is built, as a
    ``StatefulDataLoader``'s sampler draws its seed when it is built."""
    args = ["--workers", str(workers), "--loader", loader, "--reload", "--every", saves]
    run_job(tmp_path, *args, "--kill", kill, expect_kill=True)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(workers, "--reload", loader=loader))
    resumed = resumed_at(tmp_path)
    assert resumed == expected, f"resumed at step {resumed}"


@pytest.mark.parametrize("hook", ["on_train_epoch_start", "on_train_start"])
def test_a_users_draws_around_a_resume_from_an_epoch_end_checkpoint(tmp_path, reference, hook):
    """A user's callback draws from the RNG. Its ``on_train_epoch_start`` ran after the checkpoint of
    epoch 1's end, before epoch 2's shuffle: the resume puts the RNG back before that hook, not at the
    shuffle. Its ``on_train_start`` ran at the run's start, not there: the resume puts the RNG back
    after it (the strategy's ``on_train_start``, not ``AirCallback``'s)."""
    args = ["--workers", "2", "--draw-in", hook, "--every", "16"]
    run_job(tmp_path, *args, "--kill", "48:upload_start", expect_kill=True)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(2, "--draw-in", hook))
    assert resumed_at(tmp_path) == 32


@pytest.mark.parametrize(
    ("tier", "interrupt", "expected"),
    [
        (("--every", "6"), ("--kill", "18:upload_start"), 6),  # the root's step 12, batch 6
        (("--every", "100", "--local-every", "3"), ("--die", "15"), 6),  # the local tier's step 12
    ],
    ids=["root", "local-tier"],
)
def test_manual_optimization_with_two_optimizers_resumes_exactly(
    tmp_path, reference, tier, interrupt, expected
):
    """``automatic_optimization = False`` with two optimizers stepped in each batch (a GAN's pattern):
    ``global_step`` counts both, so a batch is two steps, and a save comes after the batch's second."""
    args = ["--workers", "2", "--manual", *tier]
    run_job(tmp_path, *args, *interrupt, expect_kill=True)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(2, "--manual"))
    assert resumed_at(tmp_path) == expected, "the record's step is the batch's: global_step // 2"


@pytest.mark.parametrize("finder", ["batch-size", "lr"])
def test_a_fit_with_a_finder_trains_every_sample_once_per_epoch_and_removes_its_file(tmp_path, finder):
    """``BatchSizeFinder`` and ``LearningRateFinder`` save a checkpoint before any train loader is built,
    build one per trial (each after clearing the fit's loaders), then load that checkpoint back and
    remove it: the trial loaders are replaced by the fit's own, a checkpoint of no loader starts them
    afresh, and the file goes as without air. (Relaunched, the finder's load of its own checkpoint
    replaces the one the fit was resumed from, so stock Lightning and this fit start their loops again
    at step 0.)"""
    run_job(tmp_path, "--workers", "2", f"--{finder}-finder")
    by_epoch: dict[int, list[int]] = {}
    for record in records(tmp_path):
        by_epoch.setdefault(record["epoch"], []).extend(record["ids"])
    assert sorted(by_epoch) == [0, 1, 2]
    assert all(sorted(ids) == list(range(64)) for ids in by_epoch.values()), "each sample once per epoch"
    assert not list(tmp_path.glob(".*.ckpt")), "the finder's file is removed, as without air"
    assert not (tmp_path / ".air").exists(), "and nothing of air's is left beside it"
    with AsyncCheckpointer(str(tmp_path), read_only=True) as beside:
        assert beside.list() == [], "and so is its commit"


@pytest.mark.parametrize(
    ("workers", "kill"), [("0", "12:upload_start"), ("2", "12:upload_start"), ("0", "40:commit_start")]
)
def test_two_train_loaders_one_cycled_resume_exactly(tmp_path, reference, workers, kill):
    """``train_dataloader`` returns two loaders; Lightning's ``CombinedLoader`` fetches one batch of each
    per step and starts the shorter (6 batches) again each time it runs out, a new shuffle drawn from the
    global RNG mid-epoch. Each loader is resumed, but the saved RNG goes back once, before the first
    loader's next fetch: the second one's rebuilt pass must not move the RNG the first already took and
    drew from (its main-process augmentation with ``num_workers=0``). Killed at 12 (resumed from 8) the
    shorter one starts again at 12; at 40 (from 36), at 40 too, in epoch 2."""
    args = ["--workers", workers, "--loader", "two", "--every", "4"]
    run_job(tmp_path, *args, "--kill", kill, expect_kill=True)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(int(workers), loader="two"))
    assert resumed_at(tmp_path) == int(kill.split(":")[0]) - 4


# 16 batches per epoch, a save every 4 steps. The first launch is killed in the save of step 20: the
# relaunch resumes from step 16, the checkpoint that closed epoch 0. That one is killed in the save of
# step 28: the third resumes from step 24 (20 if 24 had not committed yet), a checkpoint written after
# the first resume, mid-epoch 1.
# The train loader comes from the LightningModule, from trainer.fit(model, loader) or from a
# LightningDataModule; each must be made resumable alike, so each shares the module's reference run.
@pytest.mark.parametrize(
    ("source", "loader", "workers"),
    [
        ("fit", "plain", 0),
        ("fit", "plain", 2),
        ("datamodule", "plain", 2),
        ("module", "plain", 2),
        ("module", "stateful", 0),
    ],
)
def test_resume_after_an_epoch_closing_checkpoint_and_again_mid_epoch(
    tmp_path, reference, source, loader, workers
):
    args = ["--workers", str(workers), "--loader", loader, "--source", source, "--every", "4"]
    run_job(tmp_path, *args, "--kill", "20:upload_start", expect_kill=True)  # resumes from step 16
    run_job(tmp_path, *args, "--kill", "28:serialize_start", expect_kill=True)  # resumes from step 24
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(workers, loader=loader))


@pytest.mark.parametrize(
    ("loader", "workers", "kill"),
    [
        # torchdata StatefulDataLoader, resumes mid-epoch (step 20); augmentation from the workers' RNG
        ("stateful", 2, "24:upload_start"),
        ("iterable", 0, "24:serialize_start"),  # IterableDataset without a length, mid-epoch
        ("iterable", 2, "24:upload_start"),
        ("iterable", 0, "20:upload_start"),  # epoch boundary
    ],
)
def test_stateful_and_unsized_loaders_resume_exactly(tmp_path, reference, loader, workers, kill):
    args = ["--workers", str(workers), "--loader", loader, "--every", "4"]
    run_job(tmp_path, *args, "--kill", kill, expect_kill=True)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(workers, loader=loader))


# Sent to the job alone, and to its process group with loader workers (as SLURM and Kubernetes send it):
# a forked worker inherits the handlers, and Lightning's handler runs there as in a stock fit.
@pytest.mark.parametrize(("workers", "to"), [("0", "job"), ("2", "group")])
def test_sigterm_during_an_upload_flushes_and_commits_it_then_resumes_exactly(
    tmp_path, reference, workers, to
):
    from lightning_air import latest_checkpoint

    group = ["--sigterm-group"] if to == "group" else []
    out = subprocess.run(
        [python(), JOB, str(tmp_path), "--workers", workers, "--sigterm", "10:upload_start", *group],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    # The flush runs first, then Lightning's own SIGTERM handling: the fit stops (SIGTERMException).
    assert "SIGTERMException" in out.stderr or out.returncode != 0, "preemption stops the fit"
    assert not (tmp_path / "final.pt").exists(), "preemption stops the fit before its end"
    assert "flushed the in-flight checkpoint (SIGTERM)" in out.stderr, out.stderr[-3000:]
    newest = latest_checkpoint(str(tmp_path / "ckpts"))
    # Lightning stops the fit at its next check of the signal, which may come after a later save.
    assert newest is not None, "the in-flight save must commit"
    step = int(newest.rsplit("step=", 1)[1].removesuffix(".ckpt"))
    assert step >= 10, f"the save in flight at SIGTERM (step 10) must commit: {newest}"
    run_job(tmp_path, "--workers", workers)
    assert_same_run(tmp_path, reference(int(workers)))
