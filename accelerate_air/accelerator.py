"""``AirAccelerator``: Accelerate's ``save_state``/``load_state``, asynchronous, committed, exactly resumable.

Accelerate has no checkpoint-IO extension point (its save-state hooks run before a synchronous write
they cannot replace), so the plugin is an ``Accelerator`` subclass that overrides documented methods
and translates them into ``air_core.session.TrainingSession`` calls: ``prepare_data_loader`` (track each
loader's position per rank), ``prepare_optimizer`` (count steps; gate the step on the last snapshot),
``backward`` (the end of the step's straggler section),
``save_state`` (the files Accelerate would write, committed in the background), ``load_state`` (the
newest committed, verified checkpoint through Accelerate's own loader, then every rank's RNG and data
position) and ``end_training``.

The folder layout is Accelerate's own (``model.safetensors`` or, with ``safe_serialization=False``,
``pytorch_model.bin``; ``optimizer.bin``, ``random_states_<r>.pkl`` ...), so a downloaded checkpoint loads
with a stock ``Accelerator.load_state(local_dir)``; the extra per-rank state is ``air-rank-<r>.pt`` beside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import replace
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list
from typing_extensions import override

from air_core import (
    AirError,
    AsyncCheckpointer,
    CheckpointInfo,
    ConfigError,
    LocalCheckpoint,
    dcp,
)
from air_core.session import Place, TrainingSession, entry_of_commit
from air_core.tiers import Resume

from .folders import CheckpointNotFoundError, Folders, retention
from .internals import (
    MLFLOW_ACTIVE_RUN,
    MODELS,
    OPTIMIZERS,
    dataloaders,
    hidden,
    models,
    optimizers,
)
from .layout import (
    accelerate_files,
    air_file,
    folder_view,
    model_file_in,
    rank_state_of,
    saved_weights,
    without_dropped_aliases,
)
from .plugin import AirPlugin
from .sharded import fsdp2_sharded, load_sharded, sharded_folders
from .tracking import track_prepared

logger = logging.getLogger(__name__)
_SUPPORTED = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}


class AirAccelerator(Accelerator):
    """An ``Accelerator`` whose ``save_state`` is asynchronous and committed, and that resumes exactly.

    ``accelerator = AirAccelerator(air_plugin=AirPlugin("s3://bucket/run"), ...)``; every other argument
    is Accelerate's. Then keep Accelerate's calls: ``prepare``, ``backward``, ``save_state``,
    ``load_state``; ``resume()`` loads the newest committed checkpoint if there is one.

    Attributes:
        completed_steps: optimizer steps applied so far (restored on resume; names the checkpoints).
        start_epoch: the epoch the training loop (re-)enters after a resume: the one the first prepared
            loader was in (a loop re-entering it after its last batch gets no batches, and runs the
            rest of that epoch's code); 0 for a fresh run.
        air_session: this rank's training session (``air_session.records``: fetch times, save and
            restore records; ``air_session.goodput`` on rank 0 after ``end_training``).
    """

    def __init__(self, *args: Any, air_plugin: AirPlugin, **kwargs: Any) -> None:
        if not isinstance(air_plugin, AirPlugin):
            raise ConfigError(
                f"AirAccelerator(air_plugin={air_plugin!r}): pass accelerate_air.AirPlugin(root=...)."
            )
        super().__init__(*args, **kwargs)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != self.num_processes:
            raise ConfigError(
                f"AirAccelerator: launched as {launched} processes (WORLD_SIZE) but Accelerate runs this one "
                f"as {self.num_processes} of {self.num_processes}, so every process would write the same "
                "checkpoints. On a machine without GPUs pass AirAccelerator(cpu=True, ...) or set "
                "ACCELERATE_USE_CPU=true for a multi-CPU (gloo) run."
            )
        self._air_sharded = fsdp2_sharded(self)
        if self.distributed_type == DistributedType.FSDP and not self._air_sharded:
            raise ConfigError(
                "AirAccelerator: FSDP is checkpointed with FullyShardedDataParallelPlugin(fsdp_version=2, "
                "state_dict_type='SHARDED_STATE_DICT') (each process saves its shards); FSDP1 and full state "
                "dicts are not supported: use those settings, or a plain Accelerator."
            )
        if self.distributed_type not in _SUPPORTED and not self._air_sharded:
            raise ConfigError(
                f"AirAccelerator: distributed_type {self.distributed_type.value} is not supported yet; it "
                "checkpoints single-process, DDP (MULTI_CPU / MULTI_GPU) and FSDP2 sharded runs. Use a plain "
                "Accelerator for DeepSpeed, Megatron-LM and XLA."
            )
        self.air_plugin = air_plugin
        self.completed_steps = 0
        self.start_epoch = 0
        self.air_session = TrainingSession(
            air_plugin.session,
            checkpointer=replace(air_plugin.checkpointer, keep_last=retention(self, air_plugin)),
            rank=self.process_index,
            world_size=self.num_processes,
            broadcast=lambda value: broadcast_object_list([value])[0],
            gather=self._air_gather,
            listeners=air_plugin.listeners,
        )
        self.air_session.preflight(air_plugin.root)
        self._air = self.air_session.open(air_plugin.root)
        self._air_folders = Folders(self.air_session, self._air, air_plugin)
        self._air_tracked: set[int] = set()
        self._air_positioned: dict[int, int] = {}
        """Loaders whose position ``load_state`` restored -> their epoch then (``skip_first_batches``)."""
        self._air_said_skip = False
        self._air_reentering = False
        """Inside ``resume()``: the loop re-enters the epoch of a position at its end
        (``range(resume(), n)``); a plain ``load_state`` is followed by Accelerate's recipe, which starts
        the next epoch."""
        self._air_step_hook: Any = None
        self._air_started = False
        self._air_loading = False
        """A load is copying state in: an optimizer step now is DCP's own (``set_optimizer_state_dict``
        steps once, with zero gradients and lr, to create Adam's state), not a training step. Counted, it
        started the session at step 0 mid-load, and that start dropped the local tier's states newer than
        step 0: the one being loaded."""
        if air_plugin.session.local_every_n_steps:

            def part() -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
                place = Place("", f"step-{self.completed_steps}")
                shards = (
                    sharded_folders(place.entry, models(self), optimizers(self)) if self._air_sharded else {}
                )
                return self._air_files(place), shards

            self.air_session.local_files(part)

    # -- pickling ----------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """A pickled copy keeps the prepared objects (loaders untracked), not the checkpointing runtime:
        threads, leases and the session belong to this process's object only."""
        state = self.__dict__.copy()
        for key in ("air_session", "_air", "_air_folders", "_air_step_hook"):
            state[key] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _air_check_live(self, what: str) -> None:
        if self.air_session is None:
            raise AirError(
                f"AirAccelerator.{what}: this is a pickled copy, which does not checkpoint (its session "
                "stayed with the original); build a new AirAccelerator."
            )

    # -- preparation -------------------------------------------------------------------------
    @override
    def prepare_data_loader(
        self,
        data_loader: torch.utils.data.DataLoader,
        device_placement: Any = None,
        slice_fn_for_dispatch: Any = None,
    ) -> Any:
        prepared = super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if id(prepared) in self._air_tracked:
            return prepared
        if track_prepared(
            self.air_session,
            prepared,
            on_fetch=self._air_record_fetch,
            who="AirAccelerator",
            training=self._air_training,
        ):
            self._air_tracked.add(id(prepared))
        return prepared

    @override
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Any = None) -> Any:
        prepared = super().prepare_optimizer(optimizer, device_placement)
        # A save's copies overlap the next forward and backward; they land before any optimizer steps.
        prepared.optimizer.register_step_pre_hook(lambda *_: self.air_session.before_optimizer_step())
        self.air_session.track_optimizer(prepared.optimizer)
        if self._air_step_hook is None:  # the first optimizer's applied steps are the run's steps
            self._air_step_hook = prepared.optimizer.register_step_post_hook(self._air_count_step)
        return prepared

    @override
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """As Accelerate's; first the session ends this step's straggler section (batch -> backward)."""
        if self.air_session is not None:
            self.air_session.before_backward()
        super().backward(loss, **kwargs)

    def _air_count_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._air_loading:
            return
        if not self._air_started:  # the first step of this launch
            self._air_started = True
            tracker = self._air_tracker_run_id()
            self.air_session.start(
                step=self.completed_steps, mlflow_run_id=tracker, run_is_ours=tracker is None
            )
        self.completed_steps += 1
        self.air_session.record_step(self.completed_steps)

    @property
    def air_records(self) -> Any:
        """This rank's ``fetch_seconds`` per training batch and its save/restore records."""
        return self.air_session.records

    @property
    def air_goodput(self) -> Any:
        """Rank 0, after ``end_training``: the goodput of every launch of this job so far."""
        return self.air_session.goodput

    def _air_gather(self, values: list[float]) -> list[list[float]]:
        gathered = self.gather(torch.tensor(values, dtype=torch.float64, device=self.device))
        return gathered.view(self.num_processes, -1).tolist()

    def _air_training(self) -> bool:
        """Whether a batch fetched now is a training batch: any prepared model in training mode (a loader
        prepared like the train loader may serve an evaluation under ``model.eval()``)."""
        return any(m.training for m in models(self)) or not models(self)

    def _air_record_fetch(self, seconds: float, samples: int) -> None:
        if self._air_training():  # training batches only
            self.air_session.record_fetch(seconds, samples)
        else:  # an evaluation batch: progress for the hang watchdog, not a step
            self.air_session.record_progress()

    # -- save --------------------------------------------------------------------------------
    @override
    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs: Any
    ) -> str:
        """Snapshot the state and commit it in the background at ``output_dir``; return where.

        ``output_dir`` (a local path or URL) is the checkpoint's folder, as in Accelerate; saving the same
        folder again replaces its checkpoint (the older commit is retired once the new one commits).
        ``None``: a folder under ``air_plugin.root``, ``checkpoint_<i>`` with Accelerate's automatic
        naming, else ``step-<completed_steps>`` (``-1``, ``-2`` ... appended when the root holds a
        committed or damaged checkpoint of that name). Files written into ``output_dir`` by save-state
        pre hooks are committed too. Weights are written as Accelerate writes them: ``model.safetensors``
        (``model_<i>.safetensors``), or ``pytorch_model.bin`` (``pytorch_model_<i>.bin``) with
        ``safe_serialization=False``; FSDP2 sharded runs write DCP folders either way. Returns after
        the host copy (never waiting for an earlier save to commit beyond ``max_in_flight``); on a GPU
        the copy finishes by the next optimizer step.
        """
        self._air_check_live("save_state")
        if self.air_session.closed:
            raise AirError(
                "AirAccelerator.save_state: end_training() ended this accelerator's checkpointing (it "
                "committed what was in flight and released the root); build a new AirAccelerator to save "
                "again."
            )
        ckpt, place, name = self._air_folders.save_target(
            output_dir,
            automatic=self.project_configuration.automatic_checkpoint_naming,
            iteration=self.save_iteration,
            step=self.completed_steps,
        )
        files = self._air_files(place, safe_serialization=safe_serialization)
        if self._air_sharded:  # every process: its shards, in Accelerate's DCP folders, one commit
            shards = sharded_folders(place.entry, models(self), optimizers(self))
            self.air_session.save_sharded(
                shards, step=self.completed_steps, name=name, files=files, checkpointer=ckpt
            )
        else:
            self.air_session.save(files, step=self.completed_steps, name=name, checkpointer=ckpt)
        where = place.url
        if "://" not in where:  # as after a stock save, the folder exists (a script may add files)
            os.makedirs(where, exist_ok=True)
        self.project_configuration.iteration += 1
        return where

    def _air_files(self, place: Place, *, safe_serialization: bool = True) -> dict[str, Any]:
        """This process's files of a checkpoint in ``place``: Accelerate's, and its ``air-rank-<r>.pt``
        (the local tier's: Accelerate's default, safetensors weights)."""
        for model in models(self):  # a GPU save copies their buffers ahead of the next forward
            self.air_session.track_model(model)
        rank_state = self.air_session.rank_state()
        files = accelerate_files(
            self,
            rank_state["rng"],
            tracked=self._air_tracked,
            sharded=self._air_sharded,
            safe_serialization=safe_serialization,
        )
        files[air_file(self.process_index)] = {
            "completed_steps": self.completed_steps,
            "rank_state": rank_state,
        }
        return {place.join(f): state for f, state in files.items()}

    # -- load --------------------------------------------------------------------------------
    @override
    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs: Any
    ) -> None:
        """Load a checkpoint: ``input_dir=None`` the newest committed, verified one under the root; a
        folder a commit names (under the root, or a folder saved with ``save_state(folder)``), checksums
        verified; any other local folder (a stock checkpoint) as stock Accelerate loads it, unverified.
        Then restore every rank's RNG, data position, ``completed_steps`` and MLflow run.

        Saves of this process in flight are committed first, so a load right after a save reads it.
        With ``AirPlugin(elastic=True)`` a checkpoint of another number of processes continues: each
        process reads every saved process's small ``air-rank-<r>.pt`` and takes its share of the rest of
        the interrupted epoch (``air_core.session.elastic``).

        Raises:
            CheckpointNotFoundError: nothing committed under the root, or no folder at ``input_dir``
                (a ``FileNotFoundError``, and a ``ValueError`` as stock Accelerate raises).
            CorruptCheckpointError: ``input_dir`` is a checkpoint that never committed or is damaged.
            ConfigError: the checkpoint was written by another number of processes (without ``elastic``)
                or loaders.
        """
        self._air_check_live("load_state")
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.air_session.watchdog_paused())  # a load mid-training is no hang
            ckpt, info, folder = self._air_folders.load_source(input_dir, stack)
            if ckpt is None:  # no commit names it: as stock Accelerate loads it
                self._air_load_folder(folder, None, None, "", load_kwargs, load_model_func_kwargs)
                return
            flat = not self._air_folders.is_main(ckpt)
            self._air_load_commit(ckpt, info, stack, flat=flat, args=(load_kwargs, load_model_func_kwargs))

    def _air_load_commit(
        self,
        ckpt: AsyncCheckpointer,
        info: CheckpointInfo | None,
        stack: contextlib.ExitStack,
        *,
        flat: bool,
        args: tuple[dict | None, dict[str, Any]] = (None, {}),
        resumed: Resume | None = None,
    ) -> None:
        """Load the commit ``info`` of ``ckpt`` (None: its newest), whose files are in a folder of its root
        (or at the root itself: ``flat``); ``resumed``: the local tier's assembly it is (its tier and time
        go into the restore record)."""
        restore = (
            ckpt.restoring() if resumed is None else ckpt.restoring(tier=resumed.tier, before=resumed.seconds)
        )
        stack.enter_context(restore)  # every file and shard it reads: one restore
        local = self._air_fetch(ckpt, info)
        folder = "" if flat else entry_of_commit(local.info)
        view = stack.enter_context(folder_view(local.paths, folder))
        self._air_load_folder(view, ckpt, local.info, folder, *args)

    def _air_load_folder(
        self,
        folder: str,
        ckpt: AsyncCheckpointer | None,
        info: CheckpointInfo | None,
        prefix: str,
        load_kwargs: dict | None,
        load_model_func_kwargs: dict[str, Any],
    ) -> None:
        """Check, then load the local ``folder`` through Accelerate, then restore what it does not keep."""
        airs = self._air_rank_files(folder)
        states = {r: rank_state_of(a) for r, a in airs.items()}
        saved = int(states[0]["world_size"]) if 0 in states else self.num_processes
        label = info.name if info is not None else folder
        what = f"AirAccelerator.load_state: the checkpoint {label}"
        if states:  # every process refuses another world size (without elastic) before any weight is copied
            self.air_session.positions.check_world_size(saved, what=what)
            self._air_check_loaders(next(iter(states.values())), what=what)
        for i, model in enumerate(models(self)):  # before Accelerate copies any weight
            path = model_file_in(folder, i)  # the file Accelerate loads: safetensors first
            if path is not None:
                found = saved_weights(path)
                self.air_session.check_model(
                    without_dropped_aliases(self.unwrap_model(model).state_dict(), found),
                    found,
                    what=f"AirAccelerator.load_state: {label}/{os.path.basename(path)}",
                    fix="Resume with the model it was saved from, or give this run its own AirPlugin root.",
                )
        with contextlib.ExitStack() as stack:
            self._air_loading = True
            stack.callback(setattr, self, "_air_loading", False)
            if self._air_sharded and ckpt is not None and info is not None:  # FSDP2 shards: the core's reader
                load_sharded(ckpt, info, models(self), optimizers(self), folder=prefix)
                stack.enter_context(hidden(self, MODELS, OPTIMIZERS))  # not again from local folders
            # Files we wrote: mapped, not read into memory (Accelerate's torch.load takes no mmap for the
            # model file). Not around the sharded load: DCP's reader loads slices of files, which cannot.
            if ckpt is not None:
                stack.enter_context(_mapped_loads())
            super().load_state(folder, load_kwargs, **load_model_func_kwargs)
        needed = self.air_session.positions.ranks_to_load(saved)
        if not needed or any(r not in states for r in needed):
            log = logger.warning if ckpt is not None else logger.info  # a stock folder: said above
            log(
                "AirAccelerator.load_state(%s): no %s; RNG and data position come from Accelerate's files "
                "only, so the resumed run may repeat or skip samples.",
                label,
                air_file(self.process_index),
            )
            return
        mine = self.process_index if self.process_index in states else 0  # a process the checkpoint lacked
        self.completed_steps = airs[mine]["completed_steps"]
        reenter = self._air_reentering
        self.air_session.positions.restore({r: states[r] for r in needed}, what=what, reenter=reenter)
        tracked = [dl for dl in dataloaders(self) if id(dl) in self._air_tracked]
        for dl, position in zip(tracked, states[mine]["loaders"], strict=True):
            if position is None:
                continue
            # At an epoch's end, a loop that re-enters that epoch for the code after its batches moves
            # the loader's counter when it asks for the batch after the last (``track_prepared``), as
            # the uninterrupted one did; Accelerate's recipe starts the next epoch at once.
            dl.iteration = position["epoch"] + (1 if position["where"] == "end" and not reenter else 0)
            self._air_positioned[id(dl)] = dl.iteration  # skip_first_batches must not skip again
            if dl is tracked[0]:
                self.start_epoch = position["epoch"]
        if self.air_session.positions.loop_epoch is not None:  # the epoch the loop was in (resume())
            self.start_epoch = self.air_session.positions.loop_epoch
        if self.air_session.resumed_mlflow_run:
            self._air_continue_mlflow_run(self.air_session.resumed_mlflow_run)

    def _air_check_loaders(self, state: dict[str, Any], *, what: str) -> None:
        """Refuse a checkpoint whose data positions this process has no prepared loaders for (``resume()``
        before ``prepare``, or a loader left out), before any weight is copied."""
        saved = len(state["loaders"])
        prepared = sum(1 for dl in dataloaders(self) if id(dl) in self._air_tracked)
        if saved and saved != prepared:  # 0 saved: a checkpoint from before any loader was prepared
            raise ConfigError(
                f"{what} holds the position of {saved} prepared data loader(s); this process has prepared "
                f"{prepared}. Pass the same loaders to prepare(...) before load_state() or resume()."
            )

    def _air_fetch(self, ckpt: AsyncCheckpointer, info: CheckpointInfo | None) -> LocalCheckpoint:
        """Fetch ``info`` (None: the newest committed that verifies) into the local cache (rank 0's files
        and this process's; every process's when an elastic resume needs their rank files). Shards in
        DCP folders are left to the reader (only what is needed).

        Raises:
            CheckpointNotFoundError: ``info`` is None and nothing is committed (a ``ValueError``, as stock
                Accelerate raises when it has nothing to load).
        """
        try:
            return self._air_fetch_ranks(ckpt, info)
        except FileNotFoundError as exc:  # the core's: no committed checkpoint under the root
            if info is not None:
                raise
            stock = self._air_folders.stock_folder()
            fix = (
                f"a run without air left a checkpoint there: load it as stock Accelerate does with "
                f"load_state({stock!r})"
                if stock is not None
                else "save one first, or call resume(), which starts afresh when there is none"
            )
            raise CheckpointNotFoundError(f"AirAccelerator.load_state(): {exc}; {fix}.") from exc

    def _air_fetch_ranks(self, ckpt: AsyncCheckpointer, info: CheckpointInfo | None) -> LocalCheckpoint:
        ranks = {0, self.process_index}
        if self._air_sharded:  # one chosen checkpoint: its shards are read later, by the reader
            info = info or ckpt.latest()
        hint = info or (ckpt.latest() if self.air_plugin.session.elastic else None)
        if hint is not None and hint.manifest is not None:  # the saved world size decides
            ranks |= set(self.air_session.positions.ranks_to_load(hint.manifest.world_size))
        if self._air_sharded and info is not None and info.manifest is not None:
            shards = tuple(f"{folder}/" for folder in dcp.dcp_folders(info))
            paths = [f.path for f in info.manifest.files if f.rank in ranks and not f.path.startswith(shards)]
            local = ckpt.fetch(info, paths=paths)
        else:
            local = ckpt.fetch(info, ranks=ranks)
        manifest = local.info.manifest
        assert manifest is not None  # committed
        needed = set(self.air_session.positions.ranks_to_load(manifest.world_size))
        if not needed <= ranks:  # it fell back to another
            local = ckpt.fetch(local.info, ranks=set(range(manifest.world_size)))
        return local

    def _air_rank_files(self, folder: str) -> dict[int, dict[str, Any]]:
        """The ``air-rank-<r>.pt`` files in ``folder`` this process resumes from: rank 0's (which tells the
        saved world size) and its own, or every saved rank's for an elastic resume."""

        def read(rank: int) -> dict[str, Any] | None:
            path = os.path.join(folder, air_file(rank))
            return torch.load(path, weights_only=True) if os.path.isfile(path) else None

        airs = {r: a for r in {0, self.process_index} if (a := read(r)) is not None}
        if 0 in airs:
            saved = rank_state_of(airs[0])["world_size"]
            for r in self.air_session.positions.ranks_to_load(saved):
                if r not in airs and (a := read(r)) is not None:
                    airs[r] = a
        return airs

    @override
    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """As Accelerate's, except for a loader whose position ``load_state`` restored, in that epoch:
        it already continues after the consumed batches, so it is returned as it is (logged once)."""
        if self._air_positioned.get(id(dataloader), -1) == getattr(dataloader, "iteration", None):
            del self._air_positioned[id(dataloader)]
            if not self._air_said_skip:
                self._air_said_skip = True
                logger.info(
                    "AirAccelerator: skip_first_batches(%d) after load_state: the loader already continues "
                    "where the checkpoint left it, so no batch is skipped again",
                    num_batches,
                )
            return dataloader
        return super().skip_first_batches(dataloader, num_batches)

    def resume(self) -> int:
        """Load the newest committed checkpoint if there is one; return ``start_epoch`` (0 when fresh).

        Call after ``prepare``; then ``for epoch in range(accelerator.resume(), num_epochs)``. The
        prepared loaders continue where the checkpoint left them, mid-epoch included. With Accelerate's
        automatic naming, the next ``save_state()`` writes the folder after every one the root holds.

        Raises:
            CheckpointNotFoundError: nothing is committed, but a run without air left Accelerate
                checkpoints in the root: the message names the folder to ``load_state`` instead.
        """
        latest = self._air.latest()
        resumed = self.air_session.recover(latest.step if latest is not None else None)
        if self.project_configuration.automatic_checkpoint_naming:
            self.project_configuration.iteration = self._air_folders.next_iteration(self.save_iteration)
        if resumed is None and latest is None:
            stock = self._air_folders.stock_folder()
            if stock is not None:  # starting fresh would train over that run
                raise CheckpointNotFoundError(
                    f"AirAccelerator.resume(): nothing under {self.air_plugin.root} was committed by air, "
                    f"but a run without it left Accelerate checkpoints there (the newest: {stock}). resume() "
                    "continues committed ones only; to continue that run, load it once as stock Accelerate "
                    f"does: accelerator.load_state({stock!r}). To start a new run, use another root."
                )
            logger.info("AirAccelerator: nothing committed under %s; starting fresh", self.air_plugin.root)
            return 0
        self._air_reentering = True
        try:
            if resumed is None:
                self.load_state()
            else:  # the local tier holds a newer complete state than the root
                with contextlib.ExitStack() as stack:
                    stack.enter_context(self.air_session.watchdog_paused())
                    ckpt = stack.enter_context(self.air_session.reader(resumed.root))
                    self._air_load_commit(ckpt, None, stack, flat=False, resumed=resumed)
        finally:
            self._air_reentering = False
        return self.start_epoch

    # -- MLflow run --------------------------------------------------------------------------
    def _air_tracker_run_id(self) -> str | None:
        tracker = next((t for t in self.trackers if t.name == "mlflow"), None)
        run = None if tracker is None else MLFLOW_ACTIVE_RUN.get(tracker, None)  # set by its start()
        return run.info.run_id if run is not None else None

    def _air_continue_mlflow_run(self, run_id: str) -> None:
        """Make Accelerate's MLflow tracker log into the checkpoint's run instead of a fresh one."""
        tracker = next((t for t in self.trackers if t.name == "mlflow"), None)
        if tracker is None or not self.is_main_process or self._air_tracker_run_id() == run_id:
            return
        import mlflow

        fresh = self._air_tracker_run_id()
        mlflow.end_run()
        MLFLOW_ACTIVE_RUN.set(tracker, mlflow.start_run(run_id=run_id))
        if fresh is not None:
            mlflow.delete_run(fresh)
        logger.info("AirAccelerator: continuing MLflow run %s", run_id)

    # -- shutdown ----------------------------------------------------------------------------
    def wait_for_checkpoints(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed (raises the first failure)."""
        with self.air_session.watchdog_paused():
            self._air.flush(self.air_plugin.session.flush_timeout_seconds if timeout is None else timeout)

    @override
    def end_training(self) -> None:
        """Commit what is in flight (bounded by ``flush_timeout_seconds``), report goodput and end the
        MLflow run the session started (rank 0), then end the trackers and the process group."""
        self.air_session.close(self.completed_steps)
        super().end_training()


def _mapped_loads() -> contextlib.AbstractContextManager[object]:
    """``torch.load`` memory-maps by default inside: torch's documented default for ``mmap``
    (``torch.utils.serialization.config.load.mmap``, thread-local while patched)."""
    from torch.utils.serialization import config

    patched: contextlib.AbstractContextManager[object] = config.patch("load.mmap", True)  # type: ignore[attr-defined]
    return patched
