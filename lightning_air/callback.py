"""``AirCallback``: Lightning's training events translated into ``air_core.session.TrainingSession`` calls.

Lightning keeps only rank 0's callback state and restarts a plain ``DataLoader`` at the top of the
epoch. The session instead tracks every train loader of every rank (however it reached the Trainer:
``train_dataloader()``, ``fit(model, loader)`` or a DataModule: the loaders are tracked as the last
step of Lightning's building them, the strategy's ``process_dataloader``), puts each rank's RNG and
loader positions into the same commit (rank 0's inside the ``.ckpt``, the others as their own parts)
and resumes them exactly.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from typing_extensions import override

from air_core import ConfigError
from air_core.config import settings_of
from air_core.session import SessionConfig, TrackedLoader, TrainingSession
from air_core.session.rng import RawRng, capture_rng, raw_rng, restore_rng
from air_core.session.session import LocalPart
from air_core.tiers import tier_name

from .checkpoint_io import AIR_KEY, NEWEST, AirCheckpointIO
from .internals import (
    AFTER_SAVE_CHECKPOINT,
    CHECKPOINT_CONNECTOR,
    CHECKPOINT_SETUP,
    FILE_EXISTS,
    METADATA_FILENAME,
    MLFLOW_RUN_ID,
    PROCESS_DATALOADER,
    RESET_RESTART_STAGE,
    RESTARTED_MID_EPOCH,
    RESUME_START,
    SETUP_DATA,
    TRAIN_START,
    add_worker_init_fn,
    dump_checkpoint,
    reads_saved_files,
    replace,
    restore,
    saves_sharded_itself,
    train_loaders,
)
from .loaders import resumable
from .strategy import AirFSDPStrategy, AirModelParallelStrategy, saves_sharded, split_sharded

logger = logging.getLogger(__name__)


class AirCallback(Callback):
    """Exact resume and measurements for ``Trainer(callbacks=[AirCallback()])``; needs ``AirCheckpointIO``.

    Args:
        log_every_n_steps: window of the ``fetch_seconds`` summaries (log and MLflow).
        flush_timeout_seconds: bound on committing in-flight saves on SIGTERM, an exception or the end.
        mlflow: send the metrics to MLflow (rank 0, from a background thread): into the run of an
            ``MLFlowLogger`` if the Trainer has one, else the active run, else a new run in
            ``mlflow_experiment`` at ``MLFLOW_TRACKING_URI`` (default ``./mlflow.db``, sqlite). A resumed
            job continues the checkpoint's run. None: when MLflow is installed.
        mlflow_experiment: experiment of a new run.
        overlap_copies: copy the trained parameters and the optimizer's state on a thread during the next
            training step's forward and backward (``on_before_optimizer_step`` and validation's start wait
            for it) instead of before the save returns, as GPU copies always overlap. Only for a job in
            which nothing but the optimizer changes the weights in place between a save and the next
            optimizer step or validation (automatic optimization only; not with
            ``Embedding(max_norm=...)``). Off by default.
        elastic: resume a checkpoint written by another number of processes: the rest of the interrupted
            epoch is split over this run's ranks, every sample once, but the run is no longer bitwise equal
            to an uninterrupted one (and the global batch changes with the world size). Off: refused.
        straggler_threshold: at each window, name the ranks whose step section (batch fetched to backward)
            scores under this against the fastest rank or their own best (log, goodput log, MLflow
            ``straggler_*``). 0 or None: off.
        stop_on_straggler: when a straggler is named, commit the saves in flight and raise
            ``air_core.StragglerError`` on every rank (the fit ends as on any exception).
        preflight: check every rank's node before the fit's first step (storage canary, staging disk,
            host memory, GPUs, links and clocks between ranks; ``air preflight`` runs the same). True:
            every check; False: none; or a list of check names. A bad node stops every rank with
            ``HealthCheckError`` naming its host and check.
        hang_watchdog: stop a rank that makes no training progress for ``hang_timeout_seconds``: every
            thread's stack goes to the log and beside the checkpoints, then it exits with
            ``air_core.health.HANG_EXIT_CODE`` (87) for ``torchrun --max-restarts`` to restart the job
            from its newest commit. None: on when started by torchrun.
        hang_timeout_seconds: seconds without a training batch ending (or a validation batch) that make
            a hang; saves, loads and flushes never count. None: 10 times the 99th percentile step time,
            at least ``hang_floor_seconds`` (300: also the shortest limit of a launch's first step).
        local_every_n_steps: also checkpoint every this many optimizer steps to ``local_dir`` on this node
            (not uploaded; ``ModelCheckpoint``'s saves are unchanged), copied to ``replication_factor - 1``
            ranks of other nodes before the next optimizer step (at most this many steps lost). Sharded
            strategies save each rank's shards. Resume with ``fit(ckpt_path=lightning_air.NEWEST)``: the
            newest step every rank's state exists for, here, on a partner or under
            ``ModelCheckpoint.dirpath``. None or 0: off.
        local_dir: that node-local folder (NVMe or ``/dev/shm``). Without ``local_every_n_steps`` it is
            unused, and a warning says so.
        replication_factor: copies of each rank's local checkpoint, its own included.
    """

    def __init__(
        self,
        log_every_n_steps: int = 50,
        flush_timeout_seconds: float = 600.0,
        mlflow: bool | None = None,
        mlflow_experiment: str = "air-plugins",
        overlap_copies: bool = False,
        elastic: bool = False,
        straggler_threshold: float | None = 0.75,
        stop_on_straggler: bool = False,
        preflight: bool | list[str] = True,
        hang_watchdog: bool | None = None,
        hang_timeout_seconds: float | None = None,
        hang_floor_seconds: float = 300.0,
        local_every_n_steps: int | None = None,
        local_dir: str | None = None,
        replication_factor: int = 2,
    ) -> None:
        self.config = settings_of(SessionConfig, locals(), owner="AirCallback")
        self._local_name: str | None = None  # the local-tier save being dumped
        self.session: TrainingSession | None = None
        """The session of the running (or last) fit."""
        self._saves_at_step: dict[int, int] = defaultdict(int)
        self._quiet = contextlib.ExitStack()  # warnings filtered from the resume to the first batch
        self._rng_at_batch_end: RawRng | None = None  # what a validation right after it starts from
        self._rng_before_validation: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``ddp_spawn``'s workers, ``deepcopy(trainer)``) starts without the session: its loaders,
        generators and threads stay with the original."""
        return {**self.__dict__, "session": None, "_quiet": contextlib.ExitStack()}

    @property
    def records(self) -> Any:
        """``fetch_seconds`` per step and the save/restore records of this rank (the session's Recorder)."""
        return self.session.records if self.session is not None else None

    @property
    def goodput(self) -> Any:
        """Rank 0, after fit: the goodput of every launch of this job so far."""
        return self.session.goodput if self.session is not None else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
        ours = sum(isinstance(c, AirCallback) for c in callbacks)
        if ours > 1:  # one fit, one session: its saves, data positions and SIGTERM flush
            raise ConfigError(
                f"Trainer(callbacks=[...]) holds {ours} AirCallbacks; a fit runs with one (it owns the fit's "
                "saves, data positions and SIGTERM flush). Keep one AirCallback(...), with all its settings."
            )
        plugin = trainer.strategy.checkpoint_io
        if not isinstance(plugin, AirCheckpointIO):
            raise ConfigError(
                "AirCallback needs AirCheckpointIO: add Trainer(plugins=[lightning_air.AirCheckpointIO()]) "
                f"(found {type(plugin).__name__})."
            )
        strategy = trainer.strategy
        _check_sharded_saves_reach_the_plugin(strategy)
        if self.config.overlap_copies:
            _check_nothing_swaps_weights(trainer)

        def gather(values: list[float]) -> list[list[float]]:
            gathered = strategy.all_gather(torch.tensor(values, dtype=torch.float64))
            return gathered.reshape(trainer.world_size, -1).tolist()

        self.session = TrainingSession(
            self.config,
            checkpointer=plugin.config,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            broadcast=lambda value: strategy.broadcast(value, src=0),
            gather=gather,
            listeners=plugin.listeners,
            stop_vote=False,  # Lightning's loop stops every rank at the same step after a SIGTERM
        )
        plugin.use(self.session, pl_module)
        self.session.track_model(pl_module)
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                replace(callback, FILE_EXISTS, _WaitForSaves(callback, plugin))
        for lg in trainer.loggers:
            replace(lg, AFTER_SAVE_CHECKPOINT, _LogCommittedFiles(lg, plugin))
        tracking = _TrackTrainLoaders(trainer, self)
        replace(strategy, PROCESS_DATALOADER, tracking)
        replace(trainer.fit_loop, SETUP_DATA, _NewBuild(trainer, tracking))
        replace(strategy, TRAIN_START, _SettleResumes(trainer, self))
        connector = CHECKPOINT_CONNECTOR.get(trainer)
        replace(connector, RESUME_START, _ResolveNewest(connector, plugin))
        if trainer.checkpoint_callbacks:  # they set up after this one: the root is known once they did
            last = trainer.checkpoint_callbacks[-1]
            replace(last, CHECKPOINT_SETUP, _OpenRootAfterSetup(last, self))
        else:
            self._open_root(trainer, pl_module)

    def _open_root(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check this node and open the job's root: the first ``ModelCheckpoint``'s ``dirpath``, as its
        ``setup`` resolved it (``<log_dir>/checkpoints`` when none was given); hand the local tier its
        files."""
        assert self.session is not None
        root = getattr(trainer.checkpoint_callback, "dirpath", None)
        if self.config.local_every_n_steps and not root:
            raise ConfigError(
                "AirCallback(local_every_n_steps=...) needs a ModelCheckpoint: its dirpath is the job's "
                "root, which a NEWEST resume compares the local tier with. Add ModelCheckpoint(...) to "
                "Trainer(callbacks=[...])."
            )
        self.session.preflight(
            str(root) if root else None,
            parameter_bytes=sum(p.numel() * p.element_size() for p in pl_module.parameters()),
        )
        if root:
            self.session.open(str(root))
        if self.config.local_every_n_steps:
            self.session.local_files(lambda: self._local_part(trainer))

    def _local_part(self, trainer: pl.Trainer) -> LocalPart:
        """This rank's part of a local-tier checkpoint: rank 0 the ``.ckpt`` that ``Trainer.save_checkpoint``
        would write (a sharded strategy's: its folder's shards and ``meta.pt``), the others their state
        (and their shards)."""
        assert self.session is not None
        name = tier_name(trainer.global_step, trainer.world_size)
        sharded = saves_sharded(trainer.strategy)
        if not trainer.is_global_zero and not sharded:
            return {self.session.state_file(name): self.session.rank_state()}, {}
        self._local_name = name
        try:
            checkpoint = dump_checkpoint(trainer)
        finally:
            self._local_name = None
        if not sharded:
            return {f"{name}.ckpt": checkpoint}, {}
        shards, rest = split_sharded(trainer.strategy, checkpoint)
        folder = f"{name}.ckpt"
        if trainer.is_global_zero:
            return {f"{folder}/{METADATA_FILENAME.imported()}": rest}, {folder: shards}
        return {self.session.state_file(name): rest[AIR_KEY]["rank_state"]}, {folder: shards}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.session is not None, "AirCallback.setup did not run"
        loop, epoch = trainer.fit_loop, trainer.fit_loop.epoch_progress.current
        # Lightning types `current` as the base tracker; the fit loop's counts `processed` too.
        if RESTARTED_MID_EPOCH.get(loop) and epoch.processed == epoch.ready:  # type: ignore[attr-defined]
            # Resumed from a save in the last batch's on_train_batch_end: FitLoop.reset closed that epoch
            # (processed, completed) but left the stage "restarted mid-epoch", so the next on_advance_start
            # would neither count the epoch it starts (ready, started) nor call on_train_epoch_start, and
            # every later checkpoint would say "no epoch running": relaunched, the last one trains its epoch
            # again. End the stage as an epoch's end does (Lightning 2.6.6: fit_loop.py 398-404, 447-454).
            RESET_RESTART_STAGE.get(loop)()
        _count_from_the_share(trainer)
        if self.session.positions.resuming:
            self._quiet.enter_context(_continued_epoch_is_resumable())
        if pl_module.automatic_optimization:  # every step passes on_before_optimizer_step (manual ones
            for optimizer in trainer.optimizers:  # may step a raw optimizer, ungated)
                self.session.track_optimizer(optimizer)
        mlf = next((lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)), None)
        run_id = None
        if mlf is not None:
            resumed = self.session.resumed_mlflow_run
            if resumed is not None:
                fresh = MLFLOW_RUN_ID.get(mlf)  # rank 0: the run the logger opened for this launch
                MLFLOW_RUN_ID.set(mlf, resumed)  # its later metrics go to the checkpoint's run
                if fresh is not None and fresh != resumed:  # left empty (each relaunch left one RUNNING)
                    mlf.experiment.delete_run(fresh)  # as AirAccelerator deletes its tracker's
            run_id = mlf.run_id
        self.session.start(step=trainer.global_step, mlflow_run_id=run_id, run_is_ours=mlf is None)

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self.session is not None:
            self.session.before_backward()  # the straggler section (batch -> backward) ends

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self.session is not None:
            self.session.before_optimizer_step()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The snapshot gate too: a module may swap averaged weights in for validation in its hooks, which
        run after every callback's.

        A validation inside a fit draws from a copy of the RNG, as Lightning's sanity check does
        (``isolate_rng``): a checkpoint saved at the batch after which a validation runs (``ModelCheckpoint(
        every_n_train_steps)`` with ``val_check_interval``) resumes past that validation, which Lightning does
        not run again, so its draws must not reach the training's. They start before this hook (its
        loader's iterator draws a base seed), so the CPU generators are those of the batch's end."""
        if self.session is not None:
            self.session.before_optimizer_step()
            if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
                self._rng_before_validation = capture_rng(self._rng_at_batch_end)
            self._rng_at_batch_end = None  # one validation's: never a later fit's (a notebook's second)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The snapshot gate too: a module's ``on_train_end`` (run after this) may write other weights."""
        if self.session is not None:
            self.session.before_optimizer_step()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._quiet.close()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.session is not None:
            self.session.record_step(trainer.global_step)
            self._rng_at_batch_end = raw_rng()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # before ModelCheckpoint's on_validation_end (Lightning runs checkpoint callbacks last): its save
        # holds the RNG the training goes on with
        state, self._rng_before_validation = self._rng_before_validation, None
        if state is not None:
            restore_rng(state)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.session is not None:
            self.session.record_progress()  # validation inside fit is progress for the hang watchdog

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.session is None or self.session.closed:
            return  # a save after fit (a notebook's): no data position to resume
        step = trainer.global_step
        part = self.session.rank_state()
        if self._local_name is not None:  # a local-tier save: its parts are the tier's
            checkpoint[AIR_KEY] = {"name": self._local_name, "rank_state": part}
            return
        seq = self._saves_at_step[step]
        self._saves_at_step[step] += 1
        name = f"ckpt-{step:09d}-{self.session.launch_id[:8]}-{seq}"
        checkpoint[AIR_KEY] = {"name": name, "rank_state": part}
        if trainer.is_global_zero or saves_sharded(trainer.strategy):
            return  # in rank 0's file, or every rank's sharded save carries its own part
        root = getattr(trainer.checkpoint_callback, "dirpath", None)
        if not root:
            raise ConfigError("AirCallback needs a ModelCheckpoint with a dirpath to save every rank's part.")
        plugin = trainer.strategy.checkpoint_io
        assert isinstance(plugin, AirCheckpointIO)
        plugin.save_rank_part(str(root), part, step=step, name=name)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.session is None or self.session.closed:
            return  # validate/test/predict from a checkpoint: no training position to restore
        # A save in on_train_batch_end (the batch not yet completed) whose epoch counters say no epoch runs
        # has the lag on_train_start prevents, from a launch without that (stock Lightning, or this package
        # before it): count the running epoch, or a relaunch from the end trains the last epoch again.
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
        epochs, batches = fit_loop.get("epoch_progress"), fit_loop.get("epoch_loop.batch_progress")
        if epochs and batches:
            b, both = batches["total"], (epochs["current"], epochs["total"])
            if b["ready"] == b["started"] == b["processed"] == b["completed"] + 1 and all(
                e["ready"] == e["started"] == e["processed"] for e in both
            ):
                for e in both:
                    e["ready"], e["started"] = e["ready"] + 1, e["started"] + 1
        air = checkpoint.get(AIR_KEY)
        states: dict[int, Any] = {}
        if air is not None:  # rank 0's part is in the .ckpt; the plugin loaded the other ones needed
            states = {0: air["rank_state"], **self.session.loaded_rank_states}
        saved = states[0].get("world_size", trainer.world_size) if states else trainer.world_size
        part = states.get(trainer.global_rank)
        if any("loaders" not in s for s in states.values()) or (part is None and saved == trainer.world_size):
            logger.warning(
                "AirCallback: this checkpoint holds no %s of rank %d (not written during a fit with "
                "AirCallback: a trainer.save_checkpoint after fit, another tool, or an air-plugins version "
                "before 0.2); RNG and data position are not restored, so the resumed run may repeat or "
                "skip samples (a ModelCheckpoint save of the fit holds them).",
                "RNG and data position",
                trainer.global_rank,
            )
            return
        # Lightning would also load rank 0's loader state into every rank's loader: ours is per rank.
        checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).pop("combined_loader", None)
        self.session.positions.restore(states, what="AirCallback: the checkpoint")
        if trainer.is_global_zero:
            logger.info(
                "AirCallback: every rank's data position and RNG are restored: an interrupted epoch "
                "continues where it stopped."
            )

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self.session is not None:  # Lightning calls no teardown hook after an exception: end here
            self.session.fail(exception)
            self._end(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._end(trainer)

    def _end(self, trainer: pl.Trainer) -> None:
        """Close the session (commits what is in flight; goodput, MLflow), unhook ``ModelCheckpoint`` and
        end the plugin's asynchronous saves."""
        self._quiet.close()
        for callback in trainer.checkpoint_callbacks:
            restore(callback, FILE_EXISTS, _WaitForSaves)
            restore(callback, CHECKPOINT_SETUP, _OpenRootAfterSetup)
        for lg in trainer.loggers:
            restore(lg, AFTER_SAVE_CHECKPOINT, _LogCommittedFiles)
        restore(trainer.strategy, PROCESS_DATALOADER, _TrackTrainLoaders)
        restore(trainer.fit_loop, SETUP_DATA, _NewBuild)
        restore(trainer.strategy, TRAIN_START, _SettleResumes)
        restore(CHECKPOINT_CONNECTOR.get(trainer), RESUME_START, _ResolveNewest)
        if self.session is not None:
            self.session.close(trainer.global_step)


@contextlib.contextmanager
def _continued_epoch_is_resumable() -> Any:
    """Lightning warns, at a resume mid-epoch, that a loader without ``state_dict`` cannot continue its
    epoch ("...your dataloader is not resumable..."), as its epoch loop starts, before the first batch.
    The tracked loader does continue it exactly, so that warning is false here: it is filtered until
    the first batch (any other warning, and this one in any other fit, still shows). Only that filter is
    removed then: ``catch_warnings`` would also undo the filters the user's hooks added meanwhile. A
    user's own identical filter is left where it was."""
    filters: list[Any] = warnings.filters  # type: ignore[assignment]  # typeshed: a Sequence; it is a list
    before = list(filters)
    warnings.filterwarnings(
        "ignore",
        message="You're resuming from a checkpoint that ended before the epoch ended",
        category=PossibleUserWarning,
    )
    ours = filters[0]
    if ours in before:  # filterwarnings moved the user's to the front: put the list back as it was
        filters[:] = before
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # the user reset the filters meanwhile
            filters.remove(ours)


def _check_nothing_swaps_weights(trainer: pl.Trainer) -> None:
    """``overlap_copies`` copies the weights while the next step runs: refuse the callbacks that write other
    weights into the model between steps (after a save, before the copy may have landed)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

    averaging = (WeightAveraging, StochasticWeightAveraging)
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    swapping = [type(c).__name__ for c in callbacks if isinstance(c, averaging)]
    if swapping:
        raise ConfigError(
            f"AirCallback(overlap_copies=True) cannot run with {', '.join(swapping)}: it writes averaged "
            "weights into the model between steps, while a save's copy of them may still be running. Drop "
            "overlap_copies (saves then copy the weights before they return)."
        )


def _check_sharded_saves_reach_the_plugin(strategy: Any) -> None:
    """Lightning's sharded strategies save with DCP directly, never through the ``CheckpointIO``: refuse
    them before training rather than let every checkpoint bypass the plugin."""
    for stock, ours, setting in (
        (ModelParallelStrategy, AirModelParallelStrategy, ""),
        (FSDPStrategy, AirFSDPStrategy, "(state_dict_type='sharded')"),
    ):
        if isinstance(strategy, stock) and not isinstance(strategy, ours) and saves_sharded_itself(strategy):
            raise ConfigError(
                f"AirCallback: {stock.__name__}{setting} writes sharded checkpoints itself, bypassing "
                f"AirCheckpointIO. Use Trainer(strategy=lightning_air.{ours.__name__}(...)) with the same "
                "arguments."
            )


class _WaitForSaves:
    """``ModelCheckpoint.file_exists`` of one callback, waiting first (rank 0) for a save of that file in
    flight: it picks version suffixes (``-v1``) and rerun names by asking whether a file exists, and a save
    that returned must count, as a finished ``torch.save`` would. Picklable (``ddp_spawn``, ``deepcopy``);
    ``AirCallback.teardown`` takes it off again."""

    def __init__(self, callback: ModelCheckpoint, plugin: AirCheckpointIO) -> None:
        self.callback, self.plugin = callback, plugin

    def __call__(self, filepath: Any, trainer: pl.Trainer) -> bool:
        if trainer.is_global_zero:
            self.plugin.wait_for(str(filepath))
        return type(self.callback).file_exists(self.callback, filepath, trainer)


class _LogCommittedFiles:
    """``after_save_checkpoint`` of one logger during a fit with ``AirCallback``. ``ModelCheckpoint`` calls it
    right after ``trainer.save_checkpoint`` returns, and a logger that uploads the checkpoint files then
    (``MLFlowLogger(log_model="all")``) skips those not there yet: when it would read them, it first waits
    (rank 0, where Lightning calls it) for the saves in flight to commit, so it logs what stock logs, when
    stock logs it. Others keep the save asynchronous. Picklable, like ``_WaitForSaves``."""

    def __init__(self, logger: Any, plugin: AirCheckpointIO) -> None:
        self.logger, self.plugin = logger, plugin
        # A logger's hook is its class's, looked up at each call (a pickled copy then calls its own); a
        # stand-in such as a MagicMock (Lightning's tests use one) has it on itself only: kept here.
        self._own = (
            None if hasattr(type(logger), "after_save_checkpoint") else AFTER_SAVE_CHECKPOINT.get(logger)
        )

    def __call__(self, checkpoint_callback: Any) -> None:
        if reads_saved_files(self.logger, checkpoint_callback):
            self.plugin.wait_for_saves()
        if self._own is not None:
            self._own(checkpoint_callback)
        else:
            type(self.logger).after_save_checkpoint(self.logger, checkpoint_callback)


class _OpenRootAfterSetup:
    """The ``setup`` of the fit's last checkpoint callback during a fit with ``AirCallback``, once: Lightning
    runs checkpoint callbacks last, and ``ModelCheckpoint`` resolves its default ``dirpath`` (the logger's
    or ``default_root_dir``'s ``checkpoints``) only in its ``setup``. The root is opened once every one of
    them has resolved and checked its folder, so ours (``.air``) is not in it yet when ``ModelCheckpoint``
    warns that a folder "exists and is not empty", as with stock. Picklable, like ``_WaitForSaves``."""

    def __init__(self, callback: Any, air: AirCallback) -> None:
        self.callback, self.air = callback, air

    def __call__(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        restore(self.callback, CHECKPOINT_SETUP, _OpenRootAfterSetup)  # its own setup from here on
        self.callback.setup(trainer, pl_module, stage)
        self.air._open_root(trainer, pl_module)


class _ResolveNewest:
    """The checkpoint connector's ``resume_start`` during a fit with ``AirCallback``: Lightning hands it the
    ``ckpt_path`` it chose, which it logs ("Restoring states from the checkpoint path at ..."), loads, and
    keeps as ``trainer.ckpt_path`` for its closing "Restored all states" line. ``NEWEST`` becomes the path
    it stands for first (``AirCheckpointIO.resolve_newest``: every rank agrees, in the fit's process group),
    so Lightning names the checkpoint it restores; or None when nothing was saved anywhere, so it loads
    nothing and says nothing, as for its own ``ckpt_path="last"`` with no last checkpoint. Picklable, like
    ``_WaitForSaves``."""

    def __init__(self, connector: Any, plugin: AirCheckpointIO) -> None:
        self.connector, self.plugin = connector, plugin

    def __call__(self, checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        if str(checkpoint_path) == NEWEST:
            checkpoint_path = self.plugin.resolve_newest()
        type(self.connector).resume_start(self.connector, checkpoint_path, weights_only=weights_only)


class _TrackTrainLoaders:
    """The strategy's ``process_dataloader`` during a fit with ``AirCallback``: each train loader leaves it
    tracked by the session. Lightning hands no hook the loaders between building them (``setup_data``:
    the sampler it injects) and iterating them first, and this is the last step of building them, so
    the fit loop's first iterator is already the tracked one (workers start once, as stock). A
    rebuild (``reload_dataloaders_every_n_epochs``, ``BatchSizeFinder``'s trials) passes here again,
    and its loaders replace the ones tracked before (``_NewBuild``): a checkpoint holds the positions of
    the loaders the fit iterates, which a resume builds once. Picklable, like ``_WaitForSaves``."""

    def __init__(self, trainer: pl.Trainer, callback: AirCallback) -> None:
        self.trainer, self.callback = trainer, callback
        self.new_build = True
        """The next train loader begins a build of them (``_NewBuild``)."""

    def __call__(self, dataloader: Any) -> Any:
        trainer = self.trainer
        dataloader = type(trainer.strategy).process_dataloader(trainer.strategy, dataloader)
        session = self.callback.session
        if trainer.state.stage != RunningStage.TRAINING or session is None or session.closed:
            return dataloader
        if self.new_build:
            self.new_build = False
            session.positions.forget()
        # Lightning adds its worker seeding right after this hook; the resumable copy must carry it.
        add_worker_init_fn(dataloader, trainer.global_rank)
        return session.positions.track(
            resumable(dataloader),
            epoch=lambda: trainer.current_epoch,
            # Lightning fetches one batch ahead of a loader without a length, to know the last one.
            lookahead=0 if _has_len(dataloader) else 1,
        )


class _NewBuild:
    """The fit loop's ``setup_data`` during a fit with ``AirCallback``: each build of the train loaders
    starts in it, so the loaders ``_TrackTrainLoaders`` sees next replace the tracked ones (if it builds
    none, the next build does). Picklable, like ``_WaitForSaves``."""

    def __init__(self, trainer: pl.Trainer, tracking: _TrackTrainLoaders) -> None:
        self.trainer, self.tracking = trainer, tracking

    def __call__(self) -> None:
        self.tracking.new_build = True
        loop = self.trainer.fit_loop
        type(loop).setup_data(loop)


class _SettleResumes:
    """The strategy's ``on_train_start`` during a fit with ``AirCallback``: the last call before the first
    epoch begins, after every callback's and the module's ``on_train_start``. A resume past its epoch's
    end puts the RNG back here (``Positions.settle``), before Lightning builds the next epoch's loader
    again (``reload_dataloaders_every_n_epochs``: a sampler built then draws its seed) or runs
    ``on_train_epoch_start``. Picklable, like ``_WaitForSaves``."""

    def __init__(self, trainer: pl.Trainer, callback: AirCallback) -> None:
        self.trainer, self.callback = trainer, callback

    def __call__(self) -> None:
        strategy = self.trainer.strategy
        type(strategy).on_train_start(strategy)
        session = self.callback.session
        if session is not None and not session.closed:
            session.positions.settle(self.trainer.current_epoch)


def _count_from_the_share(trainer: pl.Trainer) -> None:
    """After an elastic resume, make Lightning's batch count of the interrupted epoch end with this rank's
    share of it: Lightning counts the epoch's batches at this world size (``num_training_batches``) from
    the checkpoint's count at the old one, so it would stop early (more ranks) or miss the end (fewer)."""
    loop = trainer.fit_loop
    combined: CombinedLoader | None = train_loaders(loop)
    if combined is None:
        return
    left = [
        n
        for dl in combined.flattened
        if isinstance(dl, TrackedLoader) and (n := dl.batches_left()) is not None
    ]
    if not left:
        return
    total = trainer.num_training_batches
    if total == float("inf") and left == [0]:  # an unsized epoch that was over: its end is the loader's
        return
    if len(combined.flattened) != 1 or total == float("inf") or total < left[0]:
        raise ConfigError(
            "AirCallback(elastic=True) continues one sized train loader at another world size, within "
            f"limit_train_batches; this fit has {len(combined.flattened)} loader(s) and {total} batches per "
            f"epoch for {left[0]} left. Resume with the number of processes the checkpoint was written by."
        )
    progress = loop.epoch_loop.batch_progress.current
    shift = int(total) - left[0] - progress.ready
    for counter in ("ready", "started", "processed", "completed"):  # as many as the epoch's loop keeps
        if hasattr(progress, counter):
            setattr(progress, counter, getattr(progress, counter) + shift)


def _has_len(loader: Any) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True
