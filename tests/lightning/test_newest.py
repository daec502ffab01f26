"""What a resume picks: ``fit(ckpt_path=NEWEST)`` and ``latest_checkpoint`` in a real Trainer, the way a
relaunch of the same command meets them (one process; the job's crash tests are in test_crash_resume)."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from air_core import ConfigError
from lightning_air import NEWEST, AirCallback, AirCheckpointIO, latest_checkpoint


class _StartedAt(pl.Callback):
    """The step a fit's training started from."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


def _trainer(root, steps: int, *callbacks: pl.Callback) -> pl.Trainer:
    return pl.Trainer(
        max_steps=steps,
        limit_val_batches=0,
        accelerator="cpu",
        plugins=[AirCheckpointIO()],
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )


def _fit(
    root, steps: int, *callbacks: pl.Callback, ckpt_path: str | None = None, model: BoringModel | None = None
) -> int | None:
    """One launch with ``default_root_dir=root``; returns the step its training started from."""
    started = _StartedAt()
    _trainer(root, steps, *callbacks, started).fit(model or BoringModel(), ckpt_path=ckpt_path)
    return started.step


def test_newest_resumes_from_model_checkpoints_default_dirpath(tmp_path, caplog):
    """No ``dirpath``: Lightning saves into ``<default_root_dir>/checkpoints``, and NEWEST resumes there,
    saying where and why at Lightning's default log level."""
    caplog.set_level(logging.INFO, logger="lightning.pytorch")

    def launch(steps: int) -> int | None:
        air = AirCallback(mlflow=False, preflight=False)
        return _fit(
            tmp_path, steps, air, ModelCheckpoint(every_n_train_steps=2, save_top_k=-1), ckpt_path=NEWEST
        )

    assert launch(4) == 0
    assert "lightning_air.NEWEST: nothing saved in any tier; starting fresh" in caplog.text
    assert (tmp_path / "checkpoints" / "epoch=0-step=4.ckpt").exists(), "Lightning's default folder"
    assert launch(6) == 4, "the relaunch resumes from the newest commit, not from scratch"
    resumed = (
        f"lightning_air.NEWEST: resuming from {tmp_path / 'checkpoints' / 'epoch=0-step=4.ckpt'} (step 4"
    )
    assert resumed in caplog.text


def _resume_lines(caplog) -> list[str]:
    """Lightning's lines about the checkpoint it restores, ours about NEWEST, any naming ``air:newest``."""
    lines = [r.getMessage() for r in caplog.records]
    return [m for m in lines if m.startswith(("Restor", "lightning_air.NEWEST")) or NEWEST in m]


def test_lightnings_resume_lines_name_the_checkpoint_newest_stands_for_and_none_start_fresh(tmp_path, caplog):
    """Lightning logs the ``ckpt_path`` it loads ("Restoring states from the checkpoint path at ...") and,
    once restored, "Restored all states from the checkpoint at ...": with ``NEWEST`` they name the file it
    stands for, after our line saying why that one; with nothing saved neither appears (it was "Restoring
    ... air:newest", ours "starting fresh", then "Restored all states ... air:newest"), as stock logs
    nothing for ``ckpt_path="last"`` without a last checkpoint. ``trainer.ckpt_path`` says the same."""
    caplog.set_level(logging.INFO, logger="lightning.pytorch")

    def launch(steps: int) -> pl.Trainer:
        caplog.clear()
        air = AirCallback(mlflow=False, preflight=False)
        trainer = _trainer(tmp_path, steps, air, ModelCheckpoint(every_n_train_steps=2))
        trainer.fit(BoringModel(), ckpt_path=NEWEST)
        return trainer

    trainer = launch(4)
    assert _resume_lines(caplog) == ["lightning_air.NEWEST: nothing saved in any tier; starting fresh"]
    assert trainer.ckpt_path is None
    trainer = launch(6)
    path = str(tmp_path / "checkpoints" / "epoch=0-step=4.ckpt")
    assert _resume_lines(caplog) == [
        f"lightning_air.NEWEST: resuming from {path} (step 4, the newest in any tier)",
        f"Restoring states from the checkpoint path at {path}",
        f"Restored all states from the checkpoint at {path}",
    ]
    assert trainer.ckpt_path == path and trainer.global_step == 6


def test_the_local_tier_runs_and_resumes_with_model_checkpoints_default_dirpath(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lightning.pytorch")

    def launch(steps: int) -> int | None:
        air = AirCallback(
            mlflow=False, preflight=False, local_every_n_steps=2, local_dir=str(tmp_path / "local")
        )
        return _fit(
            tmp_path, steps, air, ModelCheckpoint(every_n_train_steps=4, save_top_k=-1), ckpt_path=NEWEST
        )

    assert launch(7) == 0
    assert launch(9) == 6, "resumed from the local tier's step 6, newer than the root's step 4"
    assert "resuming from step 6 in this node's local tier (newer than the root's step 4)" in caplog.text
    restored = [m for m in _resume_lines(caplog) if m.startswith("Restor")]
    assert len(restored) == 2, restored
    assert all("restore-00000" in m for m in restored), "Lightning names the tier's file"


@pytest.mark.parametrize("strict_loading", [True, False])
def test_newest_without_air_callback_is_refused_before_any_step_naming_the_fix(tmp_path, strict_loading):
    """The plugin alone never learns ModelCheckpoint's dirpath: NEWEST cannot find the checkpoints there,
    and must not start from scratch beside them (``strict_loading=False`` would let it)."""

    def checkpoints() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=2, save_top_k=-1)

    _fit(tmp_path, 4, checkpoints())
    model, started = BoringModel(), _StartedAt()
    model.strict_loading = strict_loading
    with pytest.raises(ConfigError, match=r"NEWEST.*Add lightning_air\.AirCallback\(\).*latest_checkpoint"):
        _fit(tmp_path, 6, checkpoints(), started, ckpt_path=NEWEST, model=model)
    assert started.step is None, "no training may start"


def test_a_weights_only_export_is_skipped_by_newest_and_latest_checkpoint(tmp_path, caplog):
    """A notebook's ``save_checkpoint(..., weights_only=True)`` into the root after the fit holds no
    optimizer or loop state: a relaunch resumes from the newest checkpoint that has them, and says why."""
    root = tmp_path / "ckpts"

    def launch(steps: int, ckpt_path: str | None) -> tuple[pl.Trainer, int | None]:
        air, started = AirCallback(mlflow=False, preflight=False), _StartedAt()
        mc = ModelCheckpoint(dirpath=str(root), every_n_train_steps=2, save_top_k=-1)
        trainer = _trainer(tmp_path, steps, air, mc, started)
        trainer.fit(BoringModel(), ckpt_path=ckpt_path)
        return trainer, started.step

    launch(4, None)[0].save_checkpoint(str(root / "export.ckpt"), weights_only=True)
    with caplog.at_level("WARNING", logger="lightning_air"):
        assert latest_checkpoint(str(root)) == str(root / "epoch=0-step=4.ckpt")
    assert "export.ckpt): saved with weights only" in caplog.text, "the skip is logged"
    assert launch(6, NEWEST)[1] == 4, "NEWEST resumed from the newest full checkpoint"


@pytest.mark.parametrize("local_tier", [False, True], ids=["root", "local-tier"])
def test_after_a_rollback_newest_resumes_the_run_that_went_on_not_the_abandoned_one(tmp_path, local_tier):
    """A run to step 12; then a launch goes back to its step 4 (to train differently) and saves up to
    step 8. The next ``NEWEST`` resumes that launch's step 8, as Lightning's ``last`` would: the abandoned
    run's step 12 is older, though higher. By step alone it resumed step 12, from the root or from the
    local tier, which also made the rollback's local saves of steps the abandoned run had saved fail."""
    ckpts = tmp_path / "ckpts"

    def launch(steps: int, ckpt_path: str | None) -> int | None:
        tier = {"local_every_n_steps": 2, "local_dir": str(tmp_path / "local")} if local_tier else {}
        air = AirCallback(mlflow=False, preflight=False, **tier)
        every_4 = ModelCheckpoint(dirpath=str(ckpts), every_n_train_steps=4, save_top_k=-1)
        return _fit(tmp_path, steps, air, every_4, ckpt_path=ckpt_path)

    assert launch(12, None) == 0
    assert launch(8, str(ckpts / "epoch=0-step=4.ckpt")) == 4
    # Lightning names it apart from the abandoned run's file of the same step, which it finds there
    assert latest_checkpoint(str(ckpts)) == str(ckpts / "epoch=0-step=8-v1.ckpt")
    assert launch(10, NEWEST) == 8


def test_newest_over_a_stock_runs_checkpoints_refuses_naming_the_one_to_resume(tmp_path):
    """A project switching to air: the folder holds only checkpoints stock Lightning wrote. NEWEST and
    ``latest_checkpoint`` started fresh there, training over that run; they now name its ``last.ckpt``,
    and passing that path resumes it as Lightning does."""
    ckpts = tmp_path / "ckpts"
    stock = pl.Trainer(
        max_steps=6,
        limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=str(ckpts), every_n_train_steps=3, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    stock.fit(BoringModel())
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=0-step=6.ckpt", "last.ckpt"]

    def checkpoints() -> list[pl.Callback]:
        air = AirCallback(mlflow=False, preflight=False)
        return [air, ModelCheckpoint(dirpath=str(ckpts), every_n_train_steps=3, save_last=True)]

    started = _StartedAt()
    with pytest.raises(
        ConfigError, match=r"did not commit.*last\.ckpt.*fit\(ckpt_path='.*/ckpts/last\.ckpt'\)"
    ):
        _trainer(tmp_path, 9, *checkpoints(), started).fit(BoringModel(), ckpt_path=NEWEST)
    assert started.step is None, "no training may start"
    with pytest.raises(ConfigError, match="did not commit"):
        latest_checkpoint(str(ckpts))
    assert _fit(tmp_path, 9, *checkpoints(), ckpt_path=str(ckpts / "last.ckpt")) == 6
    assert latest_checkpoint(str(ckpts)) == str(ckpts / "last.ckpt"), "committed now"
