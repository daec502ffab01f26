"""Loggers that upload the checkpoint files a ``ModelCheckpoint`` save writes, from
``Logger.after_save_checkpoint`` (``MLFlowLogger(log_model="all")``), with our classes in place of
Lightning's: each run is compared with the same fit stock (``TorchCheckpointIO``), in a real MLflow store."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import MLFlowLogger

from lightning_air import AirCallback, AirCheckpointIO


def _logged_checkpoints(root, *, air: bool, log_model: bool | str, **checkpoint_kw) -> dict[str, str]:
    """Fit 12 steps, saving every 4, with an ``MLFlowLogger(log_model=...)``; return what it logged: each
    artifact's path, with the text of its ``aliases.txt`` and ``metadata.yaml`` (a ``.ckpt``'s bytes differ:
    ours holds the RNG and data position)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{root}/mlflow.db"
    logger = MLFlowLogger(
        experiment_name="e", tracking_uri=uri, artifact_location=str(root / "artifacts"), log_model=log_model
    )
    checkpoint = ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=4, **checkpoint_kw)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=12,
        limit_val_batches=0,
        logger=logger,
        plugins=[AirCheckpointIO()] if air else [],
        callbacks=[AirCallback(mlflow=False), checkpoint] if air else [checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    trainer.fit(BoringModel())
    local = MlflowClient(tracking_uri=uri).download_artifacts(logger.run_id, "", str(root / "downloaded"))
    logged = {}
    for folder, _, files in os.walk(local):
        for name in files:
            path = os.path.join(folder, name)
            logged[os.path.relpath(path, local)] = "" if name.endswith(".ckpt") else open(path).read()
    return logged


@pytest.mark.parametrize(
    ("log_model", "checkpoint_kw"),
    [
        ("all", {"save_top_k": -1}),
        # every save is a new best: top-k drops the oldest, and the newest is "best"
        ("all", {"save_top_k": 2, "monitor": "step", "mode": "max"}),
        ("all", {"save_top_k": 2, "monitor": "step", "mode": "max", "save_last": True}),
        (True, {"save_top_k": -1}),
    ],
    ids=["all-keep-all", "all-top2", "all-top2-last", "true-keep-all"],
)
def test_a_logger_uploading_each_save_logs_the_checkpoints_stock_logs(tmp_path, log_model, checkpoint_kw):
    """Lightning calls ``after_save_checkpoint`` right after ``trainer.save_checkpoint`` returns, and
    ``MLFlowLogger`` uploads the files it finds then: a save still in flight must be there, as a returned
    ``torch.save`` is (it logged none of ``save_top_k=-1``'s and never the newest of a top-k)."""
    stock = _logged_checkpoints(tmp_path / "stock", air=False, log_model=log_model, **checkpoint_kw)
    ours = _logged_checkpoints(tmp_path / "ours", air=True, log_model=log_model, **checkpoint_kw)
    assert any(p.endswith(".ckpt") for p in stock), "the stock run logs checkpoints"
    assert ours == stock, "the same checkpoints, aliases and metadata as stock"


def test_a_stand_in_logger_as_lightnings_own_tests_use_gets_its_hook_called(tmp_path):
    """Lightning's tests give the Trainer a ``MagicMock`` logger, whose ``after_save_checkpoint`` is its own
    attribute, not its class's: the fit failed with "type object 'MagicMock' has no attribute"."""
    from unittest import mock

    logger = mock.MagicMock(name="logger")
    logger.name, logger.save_dir, logger.version = "mock_logger", tmp_path, "0"
    del logger.__iter__
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        limit_val_batches=0,
        logger=logger,
        plugins=[AirCheckpointIO()],
        callbacks=[AirCallback(mlflow=False), checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    assert [c.args for c in logger.after_save_checkpoint.call_args_list] == [(checkpoint,), (checkpoint,)]
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".air", ".air-events", "epoch=0-step=4.ckpt"]
