"""``AirTrainerCallback``: transformers' ``Trainer`` checkpoints, asynchronous, committed, exactly resumable.

The callback owns one ``air_core.session.TrainingSession`` per ``train()`` call and maps Trainer's
hooks onto it: ``on_train_begin`` (track the model and optimizer, restore each process's data position
and RNG from the checkpoint resumed, start the MLflow sink, the watchdog and the SIGTERM flush),
``on_pre_optimizer_step`` (the snapshot gate), ``on_step_end`` (step timings, straggler windows, the
watchdog's beat), ``on_prediction_step`` (evaluation is progress). ``save`` builds the files
``_save_checkpoint`` would write (``layout.py``) and commits them in the background. The calls no hook
gives (the write itself, the resume path, the train loader, the step's backward) come from
``AirTrainerMixin`` (``trainer.py``), which is why the callback refuses to run under a plain ``Trainer``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import SaveStrategy

from air_core import AsyncCheckpointer, CheckpointerConfig, ConfigError, CorruptCheckpointError, Listener
from air_core.config import settings_of
from air_core.session import Owner, Place, SessionConfig, TrainingSession, entry_of_commit
from air_core.session.session import LocalPart
from air_core.storage import location

from .internals import MLFLOW_LOG_ARTIFACTS
from .layout import (
    TRAINER_STATE_NAME,
    air_file,
    model_files,
    optimizer_files,
    rng_file,
    trainer_rng,
    trainer_state_bytes,
    update_callback_states,
)
from .resume import checkpoint_url, fetch_folder, fetched, latest_checkpoint, rank_states

if TYPE_CHECKING:
    from transformers import Trainer

logger = logging.getLogger(__name__)
KEEP_ALL = 2**31 - 1
"""Retention that deletes nothing (``save_total_limit`` None or at most 0, as stock rotation)."""


class AirTrainerCallback(TrainerCallback):
    """Asynchronous, staged, committed checkpoints and exact resume for ``AirTrainer``.

    ``AirTrainer(model, args, ..., callbacks=[AirTrainerCallback(staging_dir="/nvme/air")])``; without
    one, ``AirTrainer`` adds ``AirTrainerCallback()``. Settings that ``TrainingArguments`` has stay
    there: ``output_dir`` is the root (any fsspec URL), ``save_total_limit`` the retention (applied once a
    newer checkpoint commits; the best checkpoint is kept as Trainer keeps it), ``logging_steps`` the
    metrics window (as Trainer resolves it: a ratio too), ``save_steps``/``save_strategy`` when to save.
    The arguments here are those it has not; they mean what ``accelerate_air.AirPlugin``'s do (README,
    "Settings").

    Args:
        root: where checkpoints go instead of ``args.output_dir`` (None: ``output_dir``).
        staging_dir: local folder the files are written to first (and kept in as the local cache).
        mlflow: send ``fetch_seconds``, checkpoint latency and goodput to MLflow (process 0, background
            thread): into transformers' ``MLflowCallback`` run when ``report_to`` has it, else the active
            run, else a new run. None: when MLflow is installed.
        local_every_n_steps: also checkpoint every this many optimizer steps to ``local_dir`` on this node
            (the files a save writes, not uploaded; ``save_steps`` checkpoints at the root are unchanged),
            copied to ``replication_factor - 1`` processes of other nodes before the next optimizer step
            (at most this many steps lost). ``train(resume_from_checkpoint=True)`` then continues from the
            newest step every process's state exists for, here, on a partner or at the root. None or 0: off.
        local_dir: that node-local folder (NVMe or ``/dev/shm``). Without ``local_every_n_steps`` it is
            unused, and a warning says so.
        replication_factor: copies of each process's local checkpoint, its own included (2: one partner
            on another node, so a lost node's state survives).

    Raises:
        ConfigError: a setting is invalid (named, with the fix), before anything runs.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        staging_dir: str | None = None,
        host_budget_bytes: int | None = None,
        max_in_flight: int = 1,
        on_busy: Literal["wait", "skip"] = "wait",
        writer: Literal["thread", "process"] = "thread",
        storage_options: dict[str, Any] | None = None,
        max_transfers: int = 8,
        retries: int = 5,
        commit_timeout_seconds: float = 600.0,
        flush_timeout_seconds: float = 600.0,
        mlflow: bool | None = None,
        mlflow_experiment: str = "air-plugins",
        overlap_copies: bool = False,
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
        root = os.fspath(root) if isinstance(root, os.PathLike) else root
        if root is not None and (not isinstance(root, str) or not root.strip()):
            raise ConfigError(
                f"AirTrainerCallback(root={root!r}): pass a folder or URL, or None for args.output_dir."
            )
        self.root = root
        self.session_config = settings_of(SessionConfig, locals(), owner="AirTrainerCallback")
        """The training session's settings (validated now: ``flush_timeout_seconds`` by its own name)."""
        self.checkpointer = settings_of(
            CheckpointerConfig,
            locals(),
            root=root or "output_dir",  # replaced at train(): args.output_dir
            close_timeout_seconds=flush_timeout_seconds,
            owner="AirTrainerCallback",
        )
        """The checkpointer's settings (validated now; root and retention come at ``train()``)."""
        self.listeners: list[Listener] = []
        self.session: TrainingSession | None = None
        """This process's session during ``train()`` (``session.records``: fetch times, saves, restores)."""
        self.last_session: TrainingSession | None = None
        """The session of the last ``train()`` (``last_session.goodput`` on process 0)."""
        self._trainer: Trainer | None = None
        self._ckpt: AsyncCheckpointer | None = None
        self._resumed: dict[int, dict[str, Any]] = {}
        self._resumed_from = ""
        self._mlflow_env: str | None = None
        self._said_wait = False
        self._started = False
        self._restore = contextlib.ExitStack()
        self.positioned: set[int] = set()
        """Ids of loaders whose position the session keeps: Trainer's own skip of them is not needed."""

    def add_listener(self, listener: Listener) -> None:
        """Receive the core's events (phases, save and restore records); call before ``train()``."""
        if listener not in self.listeners:
            self.listeners.append(listener)

    def __repr__(self) -> str:  # storage_options may hold credentials: never shown
        return f"AirTrainerCallback(root={self.root!r})"

    # -- AirTrainerMixin's calls ----------------------------------------------------------------------
    def bind(self, trainer: Trainer) -> None:
        """Called by ``AirTrainerMixin.__init__``: check what the trainer is set to, before any step."""
        check_supported(trainer)
        if self.session_config.local_every_n_steps and trainer.args.save_only_model:
            raise ConfigError(
                "AirTrainerCallback(local_every_n_steps=...) with TrainingArguments(save_only_model=True): "
                "a local checkpoint is only for resuming, which a save without the optimizer, scheduler "
                "and RNG cannot do. Set save_only_model=False, or local_every_n_steps=None."
            )
        self._trainer = trainer
        root = self.root_of(trainer.args)
        made = trainer.args.output_dir
        if "://" in root and made and os.path.isdir(made) and not os.listdir(made):
            # Trainer made output_dir as a local folder ("s3:/bucket/run"): nothing is written there
            with contextlib.suppress(OSError):
                os.removedirs(made)

    def root_of(self, args: TrainingArguments) -> str:
        """The checkpoint root: ``root``, else ``args.output_dir``."""
        return (self.root or args.output_dir or "trainer_output").rstrip("/")

    def begin(self, trainer: Trainer) -> None:
        """``train()`` starts: open this process's session and root (pre-flight first)."""
        if self._trainer is not trainer:
            raise ConfigError(
                "AirTrainerCallback: this callback belongs to another trainer; give each AirTrainer its own."
            )
        args = trainer.args
        limit = args.save_total_limit
        self.session = session = TrainingSession(
            self.session_config,  # the metrics window comes at on_train_begin
            checkpointer=replace(
                self.checkpointer,
                root=self.root_of(args),
                keep_last=KEEP_ALL if limit is None or limit <= 0 else int(limit),
            ),
            rank=args.process_index,
            world_size=args.world_size,
            broadcast=_broadcast,
            gather=lambda values: _gather(values, args.device),
            listeners=self.listeners,
        )
        root = self.root_of(args)
        params = trainer.model.parameters() if trainer.model is not None else ()
        weights = sum(int(p.numel() * p.element_size()) for p in params)
        session.preflight(root, parameter_bytes=weights or None)  # a checkpoint with Adam's moments: 3x
        self._ckpt = session.open(root)
        self._resumed, self._resumed_from = {}, ""
        self.positioned = set()
        self._started = False
        self._restore = contextlib.ExitStack()
        if self.session_config.local_every_n_steps:
            session.local_files(lambda: self._local_part(trainer))

    def newest(self) -> str | None:
        """``train(resume_from_checkpoint=True or NEWEST)``, every process: a local folder with the newest
        complete state across the tiers (the local tier's assembly when it is newer than the root's newest
        commit, else ``latest_checkpoint`` of the root), or None when nothing was saved anywhere."""
        session, ckpt = self.session, self._ckpt
        assert session is not None and ckpt is not None  # begin() ran
        resumed = None
        if self.session_config.local_every_n_steps:  # does the tier hold a state newer than the root's?
            latest = ckpt.latest()
            resumed = session.recover(latest.step if latest is not None else None)
        if resumed is None:
            folder = latest_checkpoint(
                ckpt.config.root,
                staging_dir=self.checkpointer.staging_dir,
                storage_options=self.checkpointer.storage_options,
            )
            if folder is not None and self.session_config.local_every_n_steps:
                logger.info("AirTrainer: resuming from %s (nothing newer in the local tier)", folder)
            return folder
        reader = self._restore.enter_context(session.reader(resumed.root))
        self._restore.enter_context(reader.restoring(tier=resumed.tier, before=resumed.seconds))
        return fetch_folder(reader, resumed.name, rank=session.rank)

    def resume_from(self, trainer: Trainer, folder: str | None) -> None:
        """Read the process states of ``folder``, the checkpoint Trainer loads (None: a fresh start)."""
        session, ckpt = self.session, self._ckpt
        assert session is not None and ckpt is not None  # begin() ran
        if folder is None:
            return
        args = trainer.args
        self._check_committed(folder)
        root_key, record = fetched.get(folder, ("", None))
        if record is not None and root_key == location(self.root_of(args)):  # that fetch, Trainer's loads
            self._restore.enter_context(ckpt.restoring(before=record.seconds, done=[record]))
        self._resumed = rank_states(folder, session, what=f"AirTrainer.train({folder!r})")
        if args.ignore_data_skip:  # the user asked for the epoch from its start: Trainer's own way
            self._resumed = {}
        self._resumed_from = folder if self._resumed else ""
        run = (self._resumed.get(0) or {}).get("mlflow_run_id")
        if run and "MLFLOW_RUN_ID" not in os.environ and _reports_to_mlflow(args):
            # transformers' MLflowCallback starts its run from this (read in its on_train_begin)
            os.environ["MLFLOW_RUN_ID"] = self._mlflow_env = run

    def _check_committed(self, folder: str) -> None:
        """Raise for a checkpoint folder under the root that no commit holds and where stock Trainer
        finished no checkpoint either: a save the job stopped while writing, which transformers'
        ``get_last_checkpoint(output_dir)`` picks as the highest-numbered folder. Stock's error for it
        ("Can't find a valid checkpoint") says neither why nor what to resume instead. A committed folder
        whose files changed since (re-sharded, as transformers' own resume tests do) is loaded as it is
        now, the way stock loads it, with a warning; without its ``trainer_state.json`` it is refused."""
        session, ckpt = self.session, self._ckpt
        assert session is not None and ckpt is not None  # begin() ran
        root = ckpt.config.root
        head, entry = os.path.split(folder.rstrip("/"))
        if location(head) != location(root):
            return
        what = f"AirTrainer.train(resume_from_checkpoint={folder!r})"
        finished = os.path.isfile(os.path.join(folder, TRAINER_STATE_NAME))  # Trainer writes it last
        try:
            committed = session.paths.committed(ckpt, Place(root, entry), what=what)
        except CorruptCheckpointError as error:  # a save of ours was writing it, or its files changed since
            broken: CorruptCheckpointError | None = error
            changed = [
                i
                for i in ckpt.catalog().infos
                if i.status == "corrupt" and i.manifest is not None and entry_of_commit(i) == entry
            ]
            if changed and finished:  # re-sharded or edited after the commit: stock loads it as it is now
                logger.warning(
                    "%s: %s was committed, but its files changed since (%s); Trainer loads the folder as it "
                    "is now, unchecked",
                    what,
                    entry,
                    changed[-1].reason,
                )
                return
        else:
            if committed is not None or finished:
                return
            broken = None
            changed = []
        newest = ckpt.latest()
        fix = (
            "Pass resume_from_checkpoint=transformers_air.NEWEST (or True), which resumes the newest "
            f"committed checkpoint, {entry_of_commit(newest)}."
            if newest is not None
            else f"Nothing under {root} is committed yet: pass "
            "resume_from_checkpoint=transformers_air.NEWEST, which then starts fresh."
        )
        if changed:
            raise CorruptCheckpointError(
                f"{what}: {entry} was committed, but its files were changed or damaged since "
                f"({changed[-1].reason}), and it holds no {TRAINER_STATE_NAME}. {fix}",
                path=folder,
                reason=changed[-1].reason,
            ) from broken
        raise CorruptCheckpointError(
            f"{what}: the save of {entry} never committed (the job stopped while writing it), so the folder "
            "holds no checkpoint; transformers' get_last_checkpoint(output_dir) picks such a folder, being "
            f"the highest-numbered. {fix}",
            path=folder,
            reason="not committed",
        ) from broken

    def track_loader(self, prepared: Any) -> None:
        """The train loader Trainer iterates (``get_train_dataloader``): its position goes in each save."""
        from accelerate_air.tracking import track_prepared

        if self.session is None:
            return
        if self.positioned:  # Trainer rebuilt it (auto_find_batch_size retries with a smaller batch)
            self.session.positions.forget()
            self.positioned = set()
        if track_prepared(self.session, prepared, on_fetch=self.session.record_fetch, who="AirTrainer"):
            self.positioned.add(id(prepared))

    def skips(self, loader: Any, batches: int) -> bool:
        """Trainer skips ``batches`` of a resumed epoch: True where this callback does it instead (the
        loader's position is the session's: restored, so nothing is skipped again, or re-read and
        dropped after a resume from a folder AirTrainer did not save, so the position counts them)."""
        if id(loader) not in self.positioned:
            return False
        if not self._resumed:
            from accelerate_air.internals import BASE_DATALOADER

            BASE_DATALOADER.get(loader).skip_next_pass(batches)
        return True

    def keep_only_best(self, trainer: Trainer) -> None:
        """The end of training with ``save_total_limit=1`` and a best checkpoint: as Trainer's own clean-up,
        every checkpoint but the best is deleted, here through the core once all saves committed (Trainer's
        ``shutil.rmtree`` would delete a save still being written and committed files behind their
        records)."""
        session, ckpt, best = self.session, self._ckpt, trainer.state.best_model_checkpoint
        if session is None or ckpt is None or best is None or trainer.args.save_total_limit != 1:
            return
        self.wait_for_checkpoints()
        if session.rank != 0:
            return
        entry = best.rstrip("/").rsplit("/", 1)[-1]
        kept = {o.name for o in session.paths.owners(ckpt, Place(ckpt.config.root, entry))}
        for info in ckpt.list():
            if info.status == "committed" and info.name not in kept:
                ckpt.delete(info.name, even_newest=True)
        self.wait_for_checkpoints()

    def restored(self, checkpoint: str | None) -> bool:
        """Whether the session restored the data position and RNG of ``checkpoint`` (Trainer's own RNG
        restore is then skipped)."""
        return bool(self._resumed_from) and checkpoint == self._resumed_from

    def before_backward(self) -> None:
        """The step's forward is done (``compute_loss`` returned): the straggler section ends."""
        if self.session is not None:
            self.session.before_backward()

    def end(self, error: BaseException | None) -> None:
        """``train()`` returns or raises: commit what is in flight (bounded), report goodput, end the run
        the session started. A save error is raised, unless ``train()`` is failing already."""
        session, self.session = self.session, None
        restore, self._restore = self._restore, contextlib.ExitStack()
        if error is None:
            restore.close()  # closed at on_train_begin already, unless training never began
        else:  # train() failed before its first step: no restore reported, readers closed
            restore.__exit__(type(error), error, error.__traceback__)
        if self._mlflow_env is not None:
            os.environ.pop("MLFLOW_RUN_ID", None)
            self._mlflow_env = None
        if session is None:
            return
        self.last_session = session
        step = self._trainer.state.global_step if self._trainer is not None else 0
        if error is not None:
            session.fail(error)
        session.close(step)

    def wait_for_checkpoints(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed (raises the first failure)."""
        if self.session is not None and self._ckpt is not None:
            with self.session.watchdog_paused():
                self._ckpt.flush(self.session_config.flush_timeout_seconds if timeout is None else timeout)

    # -- Trainer's hooks ------------------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        session = self.session
        if session is None:
            raise ConfigError(
                "AirTrainerCallback was added to a plain transformers Trainer, which writes checkpoints "
                "synchronously in a method no callback can replace; use transformers_air.AirTrainer (or "
                "AirTrainerMixin with your Trainer subclass)."
            )
        # the metrics window is Trainer's logging interval, resolved by now (a ratio of max_steps included)
        session.log_every(max(int(state.logging_steps), 1))
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is not None:
            session.track_model(model)
        if optimizer is not None:
            session.track_optimizer(getattr(optimizer, "optimizer", optimizer))
        if self._resumed:
            session.positions.restore(self._resumed, what=f"AirTrainer: the checkpoint {self._resumed_from}")
        elif state.global_step > 0:
            logger.warning(
                "AirTrainer: resumed at step %d from a folder without %s files (not saved by AirTrainer): "
                "the epoch's consumed batches are re-read and dropped, and the RNG is restored as "
                "Trainer restores it, so augmentation after the resume may differ from the original run.",
                state.global_step,
                air_file(args.process_index),
            )
        self._restore.close()  # Trainer loaded the weights, optimizer and state since ``begin``
        if state.best_model_checkpoint is None and state.best_global_step and self._ckpt is not None:
            # Trainer drops a best checkpoint it cannot see as a local folder (a remote root)
            state.best_model_checkpoint = checkpoint_url(self.root_of(args), state.best_global_step)
        if not self._started:  # once per train(), though a batch-size retry begins training again
            self._started = True
            run = _mlflow_active_run() if _reports_to_mlflow(args) else None
            session.start(step=state.global_step, mlflow_run_id=run, run_is_ours=run is None)

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A resume past an epoch's end puts the RNG back here (``Positions.settle``), not at the next
        epoch's first fetch: the ``on_epoch_begin`` of callbacks after this one draw in between, as they
        did after the checkpoint in the run it resumes (``on_train_begin``'s draws came at its start).
        Trainer's epoch is ``state.epoch``'s whole part here (the loader's is set after this hook)."""
        if self.session is not None:
            self.session.positions.settle(int(state.epoch or 0))

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:
            self.session.before_optimizer_step()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:
            self.session.record_step(state.global_step)

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:
            self.session.record_progress()

    # -- the save ------------------------------------------------------------------------------------
    def save(self, trainer: Trainer, trial: Any) -> None:
        """``Trainer._save_checkpoint``, asynchronous: the files it writes, committed as one checkpoint
        ``checkpoint-<global_step>`` under the root (retention after the commit)."""
        session, ckpt = self.session, self._ckpt
        if session is None or ckpt is None:
            raise ConfigError(
                "AirTrainer: a checkpoint save outside train(); call trainer.save_model(folder) to save "
                "the model after training."
            )
        if trial is not None:
            raise ConfigError("AirTrainer: hyperparameter_search trials are not checkpointed; use Trainer.")
        args, state = trainer.args, trainer.state
        root = self.root_of(args)
        entry = f"checkpoint-{state.global_step}"
        if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and (
            state.best_global_step
        ):
            best = f"checkpoint-{state.best_global_step}"
            if best == entry or session.paths.is_saved(ckpt, Place(root, best)):
                state.best_model_checkpoint = checkpoint_url(root, state.best_global_step)
        main = args.process_index == 0
        files = self._files(trainer, session)
        place = Place(root, entry)
        name = session.paths.fresh(ckpt, entry, place=place)
        session.paths.claim(ckpt, place, Owner(name, state.global_step, folder=True))
        if main and state.best_model_checkpoint is not None:  # retention keeps it, as rotation does
            best_entry = state.best_model_checkpoint.rstrip("/").rsplit("/", 1)[-1]
            ckpt.keep(o.name for o in session.paths.owners(ckpt, Place(root, best_entry)))
        session.save({place.join(f): s for f, s in files.items()}, step=state.global_step, name=name)
        if "://" not in root:  # as after a stock save, the folder exists (a script may add files)
            os.makedirs(place.url, exist_ok=True)
        readers = [type(c).__name__ for c in trainer.callback_handler.callbacks if _reads_checkpoints(c)]
        if readers:  # their on_save comes next and reads the folder: it must be complete
            if not self._said_wait:
                self._said_wait = True
                logger.info(
                    "AirTrainer: %s may read the checkpoint folder in on_save, so each save waits for its "
                    "commit before returning",
                    ", ".join(readers),
                )
            self.wait_for_checkpoints()

    def _files(self, trainer: Trainer, session: TrainingSession) -> dict[str, Any]:
        """The files ``_save_checkpoint`` writes in this process now, named as in its folder: process 0
        the model, optimizer and state; every process its RNG and its own state (``air_file``)."""
        args, state = trainer.args, trainer.state
        if trainer.hp_search_backend is None:
            trainer.store_flos()
        main = args.process_index == 0
        files: dict[str, Any] = {}
        if main:
            files.update(model_files(trainer))
        rank_state = session.rank_state()
        if not args.save_only_model:
            if main:
                files.update(optimizer_files(trainer))
            distributed = args.world_size > 1
            files[rng_file(args.process_index, args.world_size)] = trainer_rng(
                rank_state["rng"], distributed=distributed
            )
        if main:
            update_callback_states(trainer)
            files[TRAINER_STATE_NAME] = _bytes(trainer_state_bytes(trainer))
        files[air_file(args.process_index)] = {"global_step": state.global_step, "rank_state": rank_state}
        return files

    def _local_part(self, trainer: Trainer) -> LocalPart:
        """This process's part of a local-tier checkpoint (``local_every_n_steps``): what a save of this
        step writes, in the folder it names, so the tier's assembly loads as a root checkpoint does."""
        assert self.session is not None  # called by the session, between two steps of train()
        entry = f"checkpoint-{trainer.state.global_step}"
        return {f"{entry}/{f}": s for f, s in self._files(trainer, self.session).items()}, {}


def _reads_checkpoints(callback: TrainerCallback) -> bool:
    """Whether ``callback``'s ``on_save`` may read the checkpoint folder just saved (it overrides it;
    transformers' ``MLflowCallback`` only when it uploads artifacts)."""
    if isinstance(callback, AirTrainerCallback) or type(callback).on_save is TrainerCallback.on_save:
        return False
    from transformers.integrations import MLflowCallback

    if isinstance(callback, MLflowCallback):
        return bool(MLFLOW_LOG_ARTIFACTS.get(callback, True))
    return True


def _bytes(data: bytes) -> Any:
    from air_core.serializer import Bundle

    return Bundle([data])


def check_arguments(args: TrainingArguments | None) -> None:
    """Raise ``ConfigError`` for ``TrainingArguments`` that ``AirTrainer`` refuses, before
    ``Trainer.__init__`` acts on them (with ``push_to_hub`` it creates the Hub repository)."""
    if args is not None and args.push_to_hub:
        raise ConfigError(
            "AirTrainer(args=TrainingArguments(push_to_hub=True)): pushing checkpoints to the Hub is not "
            "done by air-plugins yet (single-process and DDP runs are checkpointed); set push_to_hub=False, "
            "or use transformers' Trainer for this run."
        )


def check_supported(trainer: Trainer) -> None:
    """Raise ``ConfigError`` for what ``AirTrainer`` does not checkpoint (yet), naming the way out."""
    unsupported = [
        (trainer.is_deepspeed_enabled, "DeepSpeed"),
        (trainer.is_fsdp_enabled, "FSDP"),
        (getattr(trainer, "is_fsdp_xla_enabled", False), "FSDP on XLA"),
    ]
    for on, what in unsupported:
        if on:
            raise ConfigError(
                f"AirTrainer: {what} is not checkpointed by air-plugins yet (single-process and DDP runs "
                "are); use transformers' Trainer for this run."
            )


def _broadcast(value: str) -> str:
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0]


def _gather(values: list[float], device: torch.device) -> list[list[float]]:
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def _reports_to_mlflow(args: TrainingArguments) -> bool:
    report_to = args.report_to if isinstance(args.report_to, list) else [args.report_to]
    return "mlflow" in report_to or "all" in report_to


def _mlflow_active_run() -> str | None:
    try:
        import mlflow
    except ImportError:
        return None
    run = mlflow.active_run()
    return run.info.run_id if run is not None else None
