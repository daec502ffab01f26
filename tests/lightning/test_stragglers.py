"""Straggler detection under Lightning: ``AirCallback.on_before_backward`` ends the timed section, and
``stop_on_straggler`` ends the fit with ``StragglerError`` after committing the saves in flight."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from air_core import StragglerError
from lightning_air import AirCallback, AirCheckpointIO, latest_checkpoint


class SlowsDownAtStep5(BoringModel):
    """Its forward takes 20 ms longer from the fifth step on: slower than its own best window."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step >= 4:
            time.sleep(0.02)
        return super().training_step(batch, batch_idx)


def test_a_rank_slower_than_its_own_best_stops_the_fit_after_committing(tmp_path):
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
    stopped = r"AirCallback\(stop_on_straggler=True\): straggler\(s\) at step 12 .*: rank 0"
    with pytest.raises(StragglerError, match=stopped) as e:
        trainer.fit(SlowsDownAtStep5())
    assert e.value.ranks == (0,)
    scores = callback.session.stragglers.last
    # slower than its first window in the second window (steps 5-8) and the third: named at step 12
    assert scores.step == 12 and scores.individual[0] < 0.75, f"slower than its first window: {scores}"
    assert callback.session.closed, "the session committed and closed before raising"
    # AirCallback's step end runs before ModelCheckpoint's: the stop comes before the save of step 12.
    newest = latest_checkpoint(str(tmp_path))
    assert newest is not None and newest.endswith("step=10.ckpt"), f"the save of step 10 committed: {newest}"
