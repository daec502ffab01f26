"""Each private (or internal) name of Lightning that ``lightning_air`` reads, writes or replaces.

Checked against Lightning 2.6.0 (the floor, ``make test-oldest``) and 2.6.6 by ``tests/lightning/
test_internals.py``. Where a public hook exists we use it (``LightningOptimizer.optimizer``, the callback
hooks); these have none:

- ``MLFlowLogger._run_id``: the run a logger writes to, set only when it creates or finds its run; a
  resumed job points it at the checkpoint's run before it logs.
- ``ModelParallelStrategy._save_distributed_checkpoint``, ``FSDPStrategy._state_dict_type``: whether a
  stock sharded strategy saves with DCP itself, bypassing the ``CheckpointIO`` (refused at setup).
- ``data_connector._auto_add_worker_init_fn``: Lightning's worker seeding, which it adds right after the
  loader hook we use; the resumable copy of a loader must carry it.
- ``_FitLoop._combined_loader``: the fit's train loaders, whose batch count an elastic resume corrects.
- ``_FitLoop.restarted_mid_epoch`` and ``reset_restart_stage`` (public names of the private loop class):
  the restart stage a resume from an epoch's last batch leaves open (``AirCallback.on_train_start``).
- ``Trainer._checkpoint_connector.dump_checkpoint``: the checkpoint dict of a local-tier save, which
  ``Trainer.save_checkpoint`` would write on rank 0 only; the connector's ``resume_start`` is replaced
  (below).
- ``lightning.fabric.utilities.load._METADATA_FILENAME``: the name of a sharded folder's ``meta.pt``.
- ``FSDPStrategy._configure_launcher`` (overridden): the first call where a CPU accelerator is known.
- ``MLFlowLogger._log_model`` (``WandbLogger``'s and ``LitLogger``'s too): whether the logger uploads the
  checkpoint files in ``after_save_checkpoint``, right after the save returns, or at ``finalize``.

Seven methods are replaced on live objects, since no hook runs at that point (``replace`` and
``restore`` below; ``AirCallback`` puts them back at the fit's end):

- ``ModelCheckpoint.setup`` (the last checkpoint callback's, once): it resolves a default ``dirpath``
  (``<log_dir>/checkpoints``), after every other callback's ``setup`` and before a resume loads; the
  job's root is opened right after it.

- ``ModelCheckpoint.file_exists``: it picks version suffixes and rerun names by asking whether a file
  exists; a save in flight must count as written, as a finished ``torch.save`` would.
- ``Strategy.process_dataloader``: the last step of building each train loader, before its first
  iterator; Lightning hands no callback the built loaders.
- ``_FitLoop.setup_data`` (the fit loop's, a private class): every build of the train loaders starts
  there, so the loaders built next replace the tracked ones (a reload, ``BatchSizeFinder``'s trials).
- ``Strategy.on_train_start``: the last call before a fit's first epoch begins (after the module's
  ``on_train_start``, which runs after every callback's); a resume past an epoch's end restores the RNG
  there, before the next epoch's loader may be built again.
- ``_CheckpointConnector.resume_start`` (the Trainer's connector): it logs ``ckpt_path`` and loads it;
  ``ckpt_path=NEWEST`` becomes the checkpoint it stands for before (None: a fresh start, logged by no one
  but us), so Lightning's lines and ``trainer.ckpt_path`` name what it restores.
- ``Logger.after_save_checkpoint`` (each logger's): ``ModelCheckpoint`` calls it right after
  ``trainer.save_checkpoint`` returns; a logger that uploads the files then must find them committed.
"""

from __future__ import annotations

from typing import Any

from air_core.internals import Touch

_CHECKED = "2.6.0 and 2.6.6"


def _lightning(where: str, why: str) -> Touch:
    return Touch("lightning", where, _CHECKED, why)


MLFLOW_RUN_ID = _lightning(
    "MLFlowLogger._run_id", "a logger has no public setter of the run it writes to (a resume continues one)"
)
SAVES_DISTRIBUTED = _lightning(
    "ModelParallelStrategy._save_distributed_checkpoint",
    "no public property says whether ModelParallelStrategy saves sharded checkpoints itself",
)
STATE_DICT_TYPE = _lightning(
    "FSDPStrategy._state_dict_type", "no public property says whether FSDPStrategy saves sharded checkpoints"
)
WORKER_INIT_FN = _lightning(
    "lightning.pytorch.trainer.connectors.data_connector._auto_add_worker_init_fn",
    "Lightning adds its worker seeding after the last loader hook, and the resumable copy must carry it",
)
COMBINED_LOADER = _lightning(
    "_FitLoop._combined_loader", "the fit loop exposes its train loaders only there during a fit"
)
CHECKPOINT_CONNECTOR = _lightning(
    "Trainer._checkpoint_connector",
    "a checkpoint dict without writing it (a local-tier save of every rank) has no public call: "
    "Trainer.save_checkpoint writes on rank 0 only, through the strategy; and the connector logs and loads "
    "ckpt_path (its resume_start)",
)
RESTARTED_MID_EPOCH = _lightning(
    "_FitLoop.restarted_mid_epoch", "the fit loop's restart stage is visible only on its private class"
)
RESET_RESTART_STAGE = _lightning(
    "_FitLoop.reset_restart_stage", "no public call ends a restart stage a resume left open"
)
METADATA_FILENAME = _lightning(
    "lightning.fabric.utilities.load._METADATA_FILENAME",
    "the stock sharded layout names its metadata file only there",
)
CONFIGURE_LAUNCHER = _lightning(
    "FSDPStrategy._configure_launcher",
    "it is the first call at which a subclass of FSDPStrategy sees the Trainer's accelerator",
)
CHECKPOINT_SETUP = _lightning(
    "ModelCheckpoint.setup",
    "ModelCheckpoint resolves its default dirpath there, after every other callback's setup, and no hook "
    "runs after it before a resume loads",
)
FILE_EXISTS = _lightning(
    "ModelCheckpoint.file_exists",
    "ModelCheckpoint asks it to name versions and reruns, and no hook lets a save in flight count",
)
PROCESS_DATALOADER = _lightning(
    "Strategy.process_dataloader", "it is the last step of building a train loader; no hook sees loaders"
)
SETUP_DATA = _lightning(
    "_FitLoop.setup_data",
    "every build of the train loaders starts there (BatchSizeFinder's trials clear the stored loaders first)",
)
TRAIN_START = _lightning(
    "Strategy.on_train_start",
    "it runs after the module's on_train_start, the last call before the first epoch",
)
LOG_MODEL = _lightning(
    "MLFlowLogger._log_model",
    "MLFlowLogger, WandbLogger and LitLogger keep their log_model setting only there, and it says whether "
    "after_save_checkpoint reads the saved files at once",
)
RESUME_START = _lightning(
    "_CheckpointConnector.resume_start",
    "it logs and loads the ckpt_path Lightning chose, with no hook in between: NEWEST becomes a path there, "
    "inside the fit (the ranks' agreement needs its process group)",
)
AFTER_SAVE_CHECKPOINT = _lightning(
    "Logger.after_save_checkpoint",
    "ModelCheckpoint calls it right after trainer.save_checkpoint returns, with no hook in between",
)


def saves_sharded_itself(strategy: Any) -> bool:
    """Whether a stock ``ModelParallelStrategy``/``FSDPStrategy`` writes sharded checkpoints with DCP
    itself (``strategy`` is one of them)."""
    from lightning.pytorch.strategies import FSDPStrategy

    if isinstance(strategy, FSDPStrategy):
        return bool(STATE_DICT_TYPE.get(strategy) == "sharded")
    return bool(SAVES_DISTRIBUTED.get(strategy))


def reads_saved_files(logger: Any, checkpoint_callback: Any) -> bool:
    """Whether ``logger.after_save_checkpoint(checkpoint_callback)`` may read the checkpoint files now.

    Lightning's loggers with ``log_model`` (MLflow, W&B, LitLogger) upload them there with
    ``log_model="all"``, or ``True`` beside ``save_top_k=-1`` (otherwise at ``finalize``, as
    ``after_save_checkpoint`` of 2.6.6 decides); the base class's and ``TensorBoardLogger``'s hook does
    nothing; any other logger's own hook may read them (stock's files exist when it runs)."""
    from lightning.pytorch import loggers

    hook = getattr(type(logger), "after_save_checkpoint", None)  # None: a stand-in (a MagicMock's own)
    if hook in (loggers.Logger.after_save_checkpoint, loggers.TensorBoardLogger.after_save_checkpoint):
        return False
    uploading = (getattr(loggers, name, None) for name in ("MLFlowLogger", "WandbLogger", "LitLogger"))
    if any(hook is getattr(cls, "after_save_checkpoint", None) for cls in uploading):
        log_model = LOG_MODEL.get(logger)
        return log_model == "all" or (log_model is True and checkpoint_callback.save_top_k == -1)
    return True


def add_worker_init_fn(dataloader: Any, rank: int) -> None:
    """Lightning's worker seeding (``seed_everything(workers=True)``), added to ``dataloader``."""
    WORKER_INIT_FN.imported()(dataloader, rank)


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint dict ``Trainer.save_checkpoint`` would write now (callbacks' hooks included)."""
    return CHECKPOINT_CONNECTOR.get(trainer).dump_checkpoint(weights_only=False)  # type: ignore[no-any-return]


def train_loaders(fit_loop: Any) -> Any:
    """The fit's ``CombinedLoader`` of train loaders (None before the fit built it)."""
    return COMBINED_LOADER.get(fit_loop)


def replace(obj: Any, touch: Touch, replacement: Any) -> None:
    """Replace the method ``touch`` names on the live ``obj`` (its class keeps the original). The method is
    looked up on ``obj`` itself, as Lightning calls it: a stand-in such as ``Mock(spec=ModelCheckpoint)``
    has it too, though not on its type."""
    touch.get(obj)
    setattr(obj, touch.attribute, replacement)


def restore(obj: Any, touch: Touch, kind: type) -> None:
    """Undo ``replace`` if ``obj`` still holds a replacement of type ``kind``: only the instance's entry
    goes (``object.__delattr__``: a ``Mock`` would remember a ``del`` as the attribute being gone)."""
    if isinstance(vars(obj).get(touch.attribute), kind):
        object.__delattr__(obj, touch.attribute)
