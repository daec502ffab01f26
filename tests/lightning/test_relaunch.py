"""Relaunching a finished job (the same command, ``ckpt_path=latest_checkpoint(dirpath)``, as a scheduler
does after a kill during teardown) trains nothing and leaves its checkpoints as they were.

The hard case is a job that resumed from the checkpoint written in the last batch of an epoch
(``ModelCheckpoint(every_n_train_steps=...)`` dividing the epoch): Lightning (2.6) closes that epoch on
restore but then starts the next one without counting it, so every later checkpoint of that launch said
"no epoch running" and the last one, relaunched, trained its epoch again. These tests relaunch after
no resume, after that resume, and after that resume followed by a mid-epoch one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_air import AirCallback, AirCheckpointIO, latest_checkpoint
from tests.lightning.model import BATCH, N_SAMPLES, Model
from tests.lightning.test_crash_resume import run_job
from tests.sameness import records

EPOCHS = 3
STEPS_PER_EPOCH = N_SAMPLES // BATCH  # 16
LAST_STEP = EPOCHS * STEPS_PER_EPOCH


def _checkpoints(root: Path) -> dict[str, str]:
    """Every ``.ckpt`` under ``root`` (our ``.air`` metadata aside): relative name -> sha256 of its bytes."""
    found = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(".air")]
        for f in files:
            if f.endswith(".ckpt"):
                path = os.path.join(d, f)
                with open(path, "rb") as fh:
                    found[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return found


def _weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def _same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kills",
    [
        pytest.param([], id="no-resume"),
        # killed in the save of step 20: the relaunch resumes from step 16, the checkpoint written in the
        # last batch of epoch 0 (on_train_batch_end), and runs to the end
        pytest.param(["20:upload_start"], id="resumed-from-the-epoch-closing-checkpoint"),
        # ... and that launch is killed in the save of step 28: the next resumes mid-epoch 1 (step 24)
        pytest.param(["20:upload_start", "28:serialize_start"], id="then-resumed-mid-epoch"),
    ],
)
def test_relaunching_a_finished_job_trains_nothing_and_keeps_its_checkpoints(tmp_path, kills):
    args = ["--every", "4", "--epochs", str(EPOCHS)]
    for kill in kills:
        run_job(tmp_path, *args, "--kill", kill, expect_kill=True)
    run_job(tmp_path, *args)
    root = tmp_path / "ckpts"
    newest = latest_checkpoint(str(root))
    assert newest is not None and newest.endswith(f"step={LAST_STEP}.ckpt"), newest
    assert torch.load(newest, weights_only=False)["global_step"] == LAST_STEP
    steps_before = [r["step"] for r in records(tmp_path)]
    assert max(steps_before) == LAST_STEP - 1, "the job ran to its end"
    files_before = _checkpoints(root)
    final_before = torch.load(tmp_path / "final.pt")

    run_job(tmp_path, *args)  # the same command again

    trained = [r["step"] for r in records(tmp_path)][len(steps_before) :]
    assert trained == [], f"the relaunch trained steps {trained[:3]}...{trained[-1:]} ({len(trained)} in all)"
    assert latest_checkpoint(str(root)) == newest
    assert torch.load(newest, weights_only=False)["global_step"] == LAST_STEP, "global_step did not grow"
    files_after = _checkpoints(root)
    assert sorted(set(files_after) - set(files_before)) == [], "the relaunch wrote no checkpoint"
    assert sorted(set(files_before) - set(files_after)) == [], "the relaunch deleted no checkpoint"
    assert files_after == files_before, "every checkpoint keeps its bytes"
    assert _same_weights(torch.load(tmp_path / "final.pt"), final_before), "the final weights are unchanged"


class _Crash(RuntimeError):
    pass


class _Witness(pl.Callback):
    """Counts the training steps and the epochs started (``on_train_epoch_start``) of one launch, and
    raises ``_Crash`` before step ``crash_before_step`` (1-based) if given."""

    def __init__(self, crash_before_step: int | None = None) -> None:
        self.crash_before_step = crash_before_step
        self.steps = 0
        self.epochs_started: list[int] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs_started.append(trainer.current_epoch)

    def on_train_batch_start(self, trainer: pl.Trainer, *_: object) -> None:
        if self.crash_before_step is not None and trainer.global_step + 1 == self.crash_before_step:
            raise _Crash(f"crash before step {self.crash_before_step}")
        self.steps += 1


def _checkpoint_callback(root: Path, save: str) -> ModelCheckpoint:
    if save == "on_train_batch_end":  # every 4 steps: the last batch of each epoch saves
        return ModelCheckpoint(dirpath=str(root), every_n_train_steps=4, save_top_k=-1)
    return ModelCheckpoint(dirpath=str(root), every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True)


def _launch(
    workdir: Path,
    root: Path,
    save: str,
    *,
    ours: bool = True,
    crash_before_step: int | None = None,
    ckpt_path: str | None = None,
) -> tuple[pl.Trainer, Model, _Witness]:
    """One launch of the same job in this process: the Model of tests/lightning, 3 epochs of 16 steps."""
    pl.seed_everything(0, workers=True)
    witness = _Witness(crash_before_step)
    air = [AirCallback(mlflow=False, preflight=False)] if ours else []
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        plugins=[AirCheckpointIO(staging_dir=str(workdir / "nvme")) if ours else TorchCheckpointIO()],
        callbacks=[*air, _checkpoint_callback(root, save), witness],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = Model(str(workdir), 0)
    if ours and ckpt_path is None:
        ckpt_path = latest_checkpoint(str(root))
    if crash_before_step is None:
        trainer.fit(model, ckpt_path=ckpt_path)
    else:
        with pytest.raises(_Crash):
            trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model, witness


@pytest.mark.parametrize("save", ["on_train_batch_end", "on_train_epoch_end"])
@pytest.mark.parametrize("crash", [False, True], ids=["no-resume", "resumed-after-epoch-0"])
def test_in_process_relaunch_after_an_epoch_closing_resume_trains_nothing(tmp_path, save, crash):
    """The same, in one process, with Lightning's counters at hand: the first launch crashes after the
    checkpoint that closed epoch 0 (step 16, committed) and the second resumes from it and finishes."""
    root = tmp_path / "ckpts"
    if crash:
        _launch(tmp_path, root, save, crash_before_step=STEPS_PER_EPOCH + 3)
        assert torch.load(latest_checkpoint(str(root)), weights_only=False)["global_step"] == STEPS_PER_EPOCH
    trainer, model, witness = _launch(tmp_path, root, save)
    assert trainer.global_step == LAST_STEP
    resumed_at = 1 if crash else 0
    assert witness.epochs_started == list(range(resumed_at, EPOCHS)), "each epoch of the launch started once"
    assert witness.steps == LAST_STEP - resumed_at * STEPS_PER_EPOCH
    newest, files, weights = latest_checkpoint(str(root)), _checkpoints(root), _weights(model.state_dict())
    lines = len(records(tmp_path))

    trainer, model, witness = _launch(tmp_path, root, save)  # relaunched: the same job again

    assert trainer.global_step == LAST_STEP, "global_step did not grow"
    assert trainer.current_epoch == EPOCHS
    assert witness.steps == 0 and len(records(tmp_path)) == lines, "no batch was trained"
    assert witness.epochs_started == []
    assert latest_checkpoint(str(root)) == newest
    assert _checkpoints(root) == files, "no checkpoint written or deleted, every one keeps its bytes"
    assert _same_weights(model.state_dict(), weights), "the final weights are unchanged"


def test_a_checkpoint_written_after_such_a_resume_by_stock_lightning_relaunches_without_training(tmp_path):
    """A checkpoint whose epoch counters lag (written by stock Lightning, or by air-plugins before this
    was fixed, in a launch that resumed from an epoch-closing checkpoint) is read as the end it is."""
    stock = tmp_path / "stock"
    _launch(tmp_path, stock, "on_train_batch_end", ours=False, crash_before_step=STEPS_PER_EPOCH + 3)
    resume_from = str(stock / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt")
    _launch(tmp_path, stock, "on_train_batch_end", ours=False, ckpt_path=resume_from)
    final = str(stock / f"epoch={EPOCHS - 1}-step={LAST_STEP}.ckpt")
    progress = torch.load(final, weights_only=False)["loops"]["fit_loop"]["epoch_progress"]["current"]
    if progress["ready"] != progress["processed"]:
        pytest.skip(f"Lightning {pl.__version__} counts the epoch after such a resume: nothing to repair")
    weights = _weights(torch.load(final, weights_only=False)["state_dict"])
    lines = len(records(tmp_path))

    ours = tmp_path / "ours"
    trainer, model, witness = _launch(tmp_path, ours, "on_train_batch_end", ckpt_path=final)

    assert trainer.global_step == LAST_STEP, "global_step did not grow"
    assert witness.steps == 0 and len(records(tmp_path)) == lines, "no batch was trained"
    assert _checkpoints(ours) == {}, "no checkpoint written"
    assert _same_weights(model.state_dict(), weights)
