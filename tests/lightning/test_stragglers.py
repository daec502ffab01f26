"""Straggler detection under Lightning: ``AirCallback.on_before_backward`` ends the timed section, and
``stop_on_straggler`` ends the fit with ``StragglerError`` after committing the saves in flight."""

from __future__ import annotations

import time

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_air import AirCallback, AirCheckpointIO, latest_checkpoint


class SlowsDownAtStep5(BoringModel):
    """Its forward takes 20 ms longer from the fifth step on: slower than its own best window."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step >= 4:
            time.sleep(0.02)
        return super().training_step(batch, batch_idx)


def test_a_one_rank_fit_that_slows_down_names_no_straggler_and_runs_to_the_end(tmp_path):
    callback = AirCallback(log_every_n_steps=4, mlflow=False, stop_on_straggler=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=16,
        limit_val_batches=0,
        plugins=[AirCheckpointIO()],
        callbacks=[callback, ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=-1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(SlowsDownAtStep5())  # no StragglerError: one rank holds nobody back
    assert callback.session.stragglers is None, "straggler detection is off in a one-rank fit"
    assert trainer.global_step == 16
    newest = latest_checkpoint(str(tmp_path))
    assert newest is not None and newest.endswith("step=16.ckpt"), newest
