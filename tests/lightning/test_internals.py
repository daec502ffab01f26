"""Every private Lightning name ``lightning_air`` touches still holds in the installed release.

Each test reads one ``lightning_air.internals`` touch on a real object, so a Lightning release that
renames it fails here with the touch's message (the attribute, the installed and the checked versions),
before a user meets it mid-fit. ``make test-oldest`` runs this file against the floor, Lightning 2.6.0.
"""

from __future__ import annotations

import inspect
from unittest.mock import Mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from air_core import AirError
from air_core.internals import Touch
from lightning_air import internals


def _trainer(tmp_path) -> pl.Trainer:
    return pl.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, max_epochs=1)


def test_the_mlflow_logger_holds_its_run_id_where_a_resume_points_it(tmp_path):
    mlf = MLFlowLogger(tracking_uri=f"sqlite:///{tmp_path}/m.db")
    assert internals.MLFLOW_RUN_ID.get(mlf) is None  # no run before it first logs
    internals.MLFLOW_RUN_ID.set(mlf, "0123abcd")
    assert internals.MLFLOW_RUN_ID.get(mlf) == "0123abcd"


def test_we_wait_for_commits_exactly_when_the_mlflow_logger_uploads_at_once(tmp_path):
    """``reads_saved_files`` repeats ``MLFlowLogger.after_save_checkpoint``'s choice (upload now, or at
    ``finalize``): checked against what the real logger uploads for a file that exists."""
    from mlflow import MlflowClient

    saved = tmp_path / "epoch=0-step=4.ckpt"
    torch.save({}, saved)
    uri = f"sqlite:///{tmp_path}/m.db"
    for log_model in (False, True, "all"):
        assert internals.LOG_MODEL.get(MLFlowLogger(tracking_uri=uri, log_model=log_model)) == log_model
        for top_k in (-1, 1, 2):
            mlf = MLFlowLogger(tracking_uri=uri, log_model=log_model, artifact_location=str(tmp_path / "a"))
            callback = ModelCheckpoint(dirpath=tmp_path, save_top_k=top_k, monitor="loss")
            callback.best_model_path = str(saved)
            mlf.after_save_checkpoint(callback)
            uploaded = bool(MlflowClient(tracking_uri=uri).list_artifacts(mlf.run_id))
            assert internals.reads_saved_files(mlf, callback) is uploaded, (log_model, top_k)


def test_loggers_whose_after_save_checkpoint_does_nothing_keep_saves_asynchronous(tmp_path):
    class OwnHook(CSVLogger):  # a user's own hook may read the files: stock's exist when it runs
        def after_save_checkpoint(self, checkpoint_callback):
            pass

    callback = ModelCheckpoint(dirpath=tmp_path)
    assert internals.reads_saved_files(CSVLogger(tmp_path), callback) is False
    assert internals.reads_saved_files(OwnHook(tmp_path), callback) is True


def test_stock_sharded_strategies_say_whether_they_save_with_dcp_themselves():
    assert internals.saves_sharded_itself(ModelParallelStrategy()) is True
    assert internals.saves_sharded_itself(ModelParallelStrategy(save_distributed_checkpoint=False)) is False
    assert internals.saves_sharded_itself(FSDPStrategy(state_dict_type="sharded")) is True
    assert internals.saves_sharded_itself(FSDPStrategy(state_dict_type="full")) is False


def test_lightning_worker_seeding_is_importable_with_its_signature():
    add = internals.WORKER_INIT_FN.imported()
    assert list(inspect.signature(add).parameters) == ["dataloader", "rank"]
    loader = torch.utils.data.DataLoader(range(4), num_workers=1)
    internals.add_worker_init_fn(loader, 0)  # seeding off: leaves the loader as it was
    assert loader.worker_init_fn is None


def test_the_fit_loop_exposes_its_train_loaders_and_restart_stage(tmp_path):
    loop = _trainer(tmp_path).fit_loop
    assert internals.train_loaders(loop) is None  # built by the fit
    assert internals.RESTARTED_MID_EPOCH.get(loop) is False
    internals.RESET_RESTART_STAGE.get(loop)()


def test_the_sharded_metadata_file_name_is_stock_lightnings():
    assert internals.METADATA_FILENAME.imported() == "meta.pt"


def test_fsdp_strategy_still_configures_its_launcher_in_the_method_we_override():
    assert callable(internals.CONFIGURE_LAUNCHER.get(FSDPStrategy))


@pytest.mark.parametrize(
    ("touch", "owner", "parameters"),
    [
        (internals.CHECKPOINT_SETUP, ModelCheckpoint, ["self", "trainer", "pl_module", "stage"]),
        (internals.FILE_EXISTS, ModelCheckpoint, ["self", "filepath", "trainer"]),
        (internals.PROCESS_DATALOADER, Strategy, ["self", "dataloader"]),
        (internals.TRAIN_START, Strategy, ["self"]),
        (internals.SETUP_DATA, _FitLoop, ["self"]),
        (internals.AFTER_SAVE_CHECKPOINT, Logger, ["self", "checkpoint_callback"]),
        (internals.RESUME_START, _CheckpointConnector, ["self", "checkpoint_path", "weights_only"]),
    ],
    ids=[
        "setup",
        "file_exists",
        "process_dataloader",
        "on_train_start",
        "setup_data",
        "after_save_checkpoint",
        "resume_start",
    ],
)
def test_methods_replaced_on_live_objects_keep_their_signature(tmp_path, touch, owner, parameters):
    assert list(inspect.signature(touch.get(owner)).parameters) == parameters
    callback = ModelCheckpoint(dirpath=tmp_path)

    class Stand:
        def __call__(self, *args):
            return "ours"

    internals.replace(callback, internals.FILE_EXISTS, Stand())
    assert callback.file_exists("x", None) == "ours"
    internals.restore(callback, internals.FILE_EXISTS, Stand)
    assert "file_exists" not in vars(callback)


def test_a_stand_in_checkpoint_callback_gets_the_replacement_as_a_real_one_does():
    """NeMo's pattern, in Lightning's own tests: ``Mock(spec=ModelCheckpoint)`` as the Trainer's callback.
    Its type lacks the method (a mock makes it on the instance): the lookup is on the object, and the
    undo leaves the mock as it was, for the next fit."""
    stand_in = Mock(spec=ModelCheckpoint)
    for _ in range(2):  # a second fit replaces it again
        internals.replace(stand_in, internals.FILE_EXISTS, "ours")
        assert stand_in.file_exists == "ours"
        internals.restore(stand_in, internals.FILE_EXISTS, str)
        assert isinstance(stand_in.file_exists, Mock), "the mock's own again"


def test_a_renamed_private_name_fails_naming_it_and_the_checked_release():
    gone = Touch("lightning", "MLFlowLogger._run_id_v2", "2.6.0 and 2.6.6", "a test")
    with pytest.raises(AirError, match=r"lightning 2\.\d+\.\d+ changed MLFlowLogger\._run_id_v2.*2\.6\.0"):
        gone.get(MLFlowLogger(tracking_uri="sqlite:///:memory:"))
    with pytest.raises(AirError, match=r"changed lightning\.nowhere\._thing"):
        Touch("lightning", "lightning.nowhere._thing", "2.6.6", "a test").imported()
