"""``AirAccelerator``: Accelerate's ``save_state``/``load_state``, asynchronous, committed, exactly resumable.

Accelerate has no checkpoint-IO extension point (its save-state hooks run before a synchronous write
they cannot replace), so the plugin is an ``Accelerator`` subclass that overrides documented methods
and translates them into ``air_core.session.TrainingSession`` calls: ``prepare_data_loader`` (track each
loader's position per rank), ``prepare_optimizer`` (count steps; gate the step on the last snapshot),
``save_state`` (the files Accelerate would write, committed in the background), ``load_state`` (the
newest committed, verified checkpoint through Accelerate's own loader, then every rank's RNG and data
position) and ``end_training``.

The folder layout is Accelerate's own (``pytorch_model.bin``, ``optimizer.bin``, ``random_states_<r>.pkl``
...), so a downloaded checkpoint loads with a stock ``Accelerator.load_state(local_dir)``; the extra
per-rank state is ``air-rank-<r>.pt`` beside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderShard
from accelerate.utils import DistributedType, broadcast_object_list
from torch.utils.data import RandomSampler
from typing_extensions import override

from air_core import ConfigError, dcp
from air_core.session import TrainingSession

from .layout import accelerate_files, air_file, batch_layout, model_file, rank_state_of
from .plugin import AirPlugin, warn_if_inexact
from .sharded import fsdp2_sharded, load_sharded, sharded_folders

logger = logging.getLogger(__name__)
_SUPPORTED = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}


@contextlib.contextmanager
def _hidden(obj: Any, *lists: str) -> Iterator[None]:
    """Empty the named list attributes of ``obj`` for the duration (restored even on an exception)."""
    saved = {name: getattr(obj, name) for name in lists}
    try:
        for name in lists:
            setattr(obj, name, [])
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def _start_epochs_at_iter(prepared: Any) -> None:
    """Make a stateful loader draw each epoch's order when it is iterated, as a plain loader does.

    Accelerate asks a new multi-worker ``StatefulDataLoader`` for its state, which makes it start its
    first epoch (and draw that epoch's order) inside ``prepare``; that iterator is dropped so the first
    epoch starts at ``iter()`` like the others. A shuffling sampler without a generator gets one (as
    Accelerate does for its multi-process loaders), so its order is part of the saved position.
    """
    base = prepared.base_dataloader
    if getattr(base, "_initial_iter_for_state_dict", False):  # torchdata's flag for that early iterator
        base._iterator = None
        base._initial_iter_for_state_dict = False
    sampler = prepared.get_sampler()
    if type(sampler) is RandomSampler and sampler.generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        sampler.generator = torch.Generator().manual_seed(seed)


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
                "checkpoints. On a machine without GPUs pass Accelerator(cpu=True) or set "
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
            checkpointer=air_plugin.checkpointer,
            rank=self.process_index,
            world_size=self.num_processes,
            broadcast=lambda value: broadcast_object_list([value])[0],
            gather=self._air_gather,
            listeners=air_plugin.listeners,
        )
        self._air = self.air_session.open(air_plugin.root)
        self._air_tracked: set[int] = set()
        self._air_taken: set[str] | None = None
        """Checkpoint names under the root (listed at the first save) and of this launch's saves."""
        self._air_step_hook: Any = None
        self._air_started = False

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
        if type(prepared) is not DataLoaderShard:
            logger.warning(
                "AirAccelerator: %s loaders cannot resume exactly mid-epoch (only per-rank sharded loaders "
                "can); set DataLoaderConfiguration(dispatch_batches=False) to resume exactly.",
                type(prepared).__name__,
            )
            return prepared
        warn_if_inexact(prepared)
        stateful = getattr(prepared, "use_stateful_dataloader", False)
        if stateful:
            _start_epochs_at_iter(prepared)
        layout = batch_layout(prepared.base_dataloader)
        prepared.base_dataloader = self.air_session.track(
            prepared.base_dataloader,
            epoch=lambda: int(prepared.iteration),
            lookahead=1,  # a DataLoaderShard fetches one batch ahead to detect the end
            # Accelerate corrects a stateful loader's state for that batch.
            exact_state=(prepared.state_dict, prepared.load_state_dict) if stateful else None,
            on_fetch=self._air_record_fetch,
            reenter=True,  # resume() returns the finished epoch: the loop runs the code after its batches
            layout=layout,  # how the batches are dealt to processes, for a resume at another count
        )
        self._air_tracked.add(id(prepared))
        return prepared

    @override
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Any = None) -> Any:
        prepared = super().prepare_optimizer(optimizer, device_placement)
        if self._air_step_hook is None:  # the first optimizer's applied steps are the run's steps
            # A save's device-to-host copy overlaps the next forward/backward; it lands before the step.
            prepared.optimizer.register_step_pre_hook(lambda *_: self.air_session.before_optimizer_step())
            self._air_step_hook = prepared.optimizer.register_step_post_hook(self._air_count_step)
        return prepared

    def _air_count_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._air_started:  # the first step of this launch
            self._air_started = True
            tracker = self._air_tracker_run_id()
            self.air_session.start(mlflow_run_id=tracker, run_is_ours=tracker is None)
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

    def _air_record_fetch(self, seconds: float) -> None:
        if any(m.training for m in self._models) or not self._models:  # training batches only
            self.air_session.record_fetch(seconds)

    # -- save --------------------------------------------------------------------------------
    @override
    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs: Any
    ) -> str:
        """Snapshot the state and commit it in the background under ``air_plugin.root``; return its URL.

        ``output_dir`` names the checkpoint (its last path segment); by default it is
        ``step-<completed_steps>`` (``-1``, ``-2``, ... appended when the root holds a committed or
        corrupt checkpoint of that name, e.g. one that resume skipped: such a location is never
        written twice). Model weights are written as ``pytorch_model.bin`` (torch format, whatever
        ``safe_serialization`` says), which a stock ``load_state`` reads as well. Returns after the
        host copy; on a GPU the copy finishes by the next optimizer step.
        """
        name = self._air_name(output_dir)
        rank_state = self.air_session.rank_state()
        files = accelerate_files(self, rank_state["rng"], sharded=self._air_sharded)
        files[air_file(self.process_index)] = {
            "completed_steps": self.completed_steps,
            "rank_state": rank_state,
        }
        files = {f"{name}/{f}": state for f, state in files.items()}
        if self._air_sharded:  # every process: its shards, in Accelerate's DCP folders, one commit
            folders = sharded_folders(name, self._models, self._optimizers)
            self.air_session.save_sharded(folders, step=self.completed_steps, name=name, files=files)
        else:
            self.air_session.save(files, step=self.completed_steps, name=name)
        self.project_configuration.iteration += 1
        return f"{self.air_plugin.root.rstrip('/')}/{name}"

    def _air_name(self, output_dir: str | None) -> str:
        if output_dir is None:
            base = f"step-{self.completed_steps:09d}"
        else:
            base = os.path.basename(os.path.normpath(str(output_dir)))
        if self._air_taken is None:  # a committed location is never written twice, not even a corrupt one
            # Partial saves do not count: they are never loaded, and another rank's first intent record
            # may already be there (every rank must choose the same name). No commit of this launch can
            # exist before every rank has listed, so the ranks agree.
            self._air_taken = {info.name for info in self._air.list() if info.status != "partial"}
        name, n = base, 0
        while name in self._air_taken:
            n += 1
            name = f"{base}-{n}"
        self._air_taken.add(name)
        return name

    # -- load --------------------------------------------------------------------------------
    @override
    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs: Any
    ) -> None:
        """Load the newest committed, verified checkpoint (``input_dir=None``), the checkpoint of that
        name under the root, or an existing local folder; then restore every rank's RNG, data
        position, ``completed_steps`` and MLflow run.

        With ``AirPlugin(elastic=True)`` a checkpoint of another number of processes continues: each
        process reads every saved process's small ``air-rank-<r>.pt`` and takes its share of the rest of
        the interrupted epoch (``air_core.session.elastic``).

        Raises:
            FileNotFoundError: nothing committed under the root, or no checkpoint of that name.
            ConfigError: the checkpoint was written by another number of processes (without ``elastic``)
                or loaders.
        """
        info = None
        if input_dir is not None and os.path.isdir(os.path.expanduser(str(input_dir))):
            folder = os.path.expanduser(str(input_dir))
        else:
            if input_dir is not None:
                wanted = os.path.basename(os.path.normpath(str(input_dir)))
                committed = {i.name: i for i in self._air.list() if i.status == "committed"}
                if wanted not in committed:
                    raise FileNotFoundError(
                        f"AirAccelerator.load_state({input_dir!r}): no committed checkpoint {wanted!r} under "
                        f"{self.air_plugin.root}; committed: {sorted(committed) or 'none'}."
                    )
                info = committed[wanted]
            folder, info = self._air_fetch(info)
        airs = self._air_rank_files(folder)
        states = {r: rank_state_of(a) for r, a in airs.items()}
        saved = int(states[0]["world_size"]) if 0 in states else self.num_processes
        what = f"AirAccelerator.load_state: the checkpoint {os.path.basename(folder)}"
        if states:  # every process refuses another world size (without elastic) before any weight is copied
            self.air_session.check_world_size(saved, what=what)
        for i, model in enumerate(self._models):  # before Accelerate copies any weight
            path = os.path.join(folder, model_file(i))
            if os.path.isfile(path):
                self.air_session.check_model(
                    self.unwrap_model(model).state_dict(),
                    torch.load(path, map_location="cpu", weights_only=True, mmap=True),
                    what=f"AirAccelerator.load_state: {os.path.basename(folder)}/{model_file(i)}",
                    fix="Resume with the model it was saved from, or give this run its own AirPlugin root.",
                )
        if self._air_sharded and info is not None:  # FSDP2 shards through the core's reader, the rest stock
            load_sharded(self._air, info, self._models, self._optimizers)
            with _hidden(self, "_models", "_optimizers"):  # Accelerate would read them from local folders
                super().load_state(folder, load_kwargs, **load_model_func_kwargs)
        else:
            super().load_state(folder, load_kwargs, **load_model_func_kwargs)
        needed = self.air_session.ranks_to_load(saved)
        if not needed or any(r not in states for r in needed):
            logger.warning(
                "AirAccelerator.load_state(%s): no %s; RNG and data position come from Accelerate's files "
                "only, so the resumed run may repeat or skip samples.",
                folder,
                air_file(self.process_index),
            )
            return
        mine = self.process_index if self.process_index in states else 0  # a process the checkpoint lacked
        self.completed_steps = airs[mine]["completed_steps"]
        self.air_session.restore_rank_states({r: states[r] for r in needed}, what=what)
        for dl, position in zip(self._dataloaders, states[mine]["loaders"], strict=True):
            if position is None:
                continue
            # At an epoch's end the loop re-enters that epoch for the code after its batches; the
            # loader's next real pass is the following epoch.
            dl.iteration = position["epoch"] + (1 if position["where"] == "end" else 0)
            if dl is self._dataloaders[0]:
                self.start_epoch = position["epoch"]
        if self.air_session.resumed_mlflow_run:
            self._air_continue_mlflow_run(self.air_session.resumed_mlflow_run)

    def _air_fetch(self, info: Any) -> tuple[str, Any]:
        """Fetch ``info`` (None: the newest committed that verifies) into the local cache (rank 0's files
        and this process's; every process's when an elastic resume needs their rank files); return the
        folder and the checkpoint. Shards in DCP folders are left to the reader (only what is needed)."""
        ranks = {0, self.process_index}
        if self._air_sharded:  # one chosen checkpoint: its shards are read later, by the reader
            info = info or self._air.latest()
        hint = info or (self._air.latest() if self.air_plugin.session.elastic else None)
        if hint is not None and hint.manifest is not None:  # the saved world size decides
            ranks |= set(self.air_session.ranks_to_load(hint.manifest.world_size))
        if self._air_sharded and info is not None and info.manifest is not None:
            shards = tuple(f"{folder}/" for folder in dcp.dcp_folders(info))
            paths = [f.path for f in info.manifest.files if f.rank in ranks and not f.path.startswith(shards)]
            local = self._air.fetch(info, paths=paths)
        else:
            local = self._air.fetch(info, ranks=ranks)
        manifest = local.info.manifest
        assert manifest is not None  # committed
        if not set(self.air_session.ranks_to_load(manifest.world_size)) <= ranks:  # it fell back to another
            local = self._air.fetch(local.info, ranks=set(range(manifest.world_size)))
        return os.path.dirname(next(iter(local.paths.values()))), local.info  # all under <name>/

    def _air_rank_files(self, folder: str) -> dict[int, dict[str, Any]]:
        """The ``air-rank-<r>.pt`` files in ``folder`` this process resumes from: rank 0's (which tells the
        saved world size) and its own, or every saved rank's for an elastic resume."""

        def read(rank: int) -> dict[str, Any] | None:
            path = os.path.join(folder, air_file(rank))
            return torch.load(path, weights_only=True) if os.path.isfile(path) else None

        airs = {r: a for r in {0, self.process_index} if (a := read(r)) is not None}
        if 0 in airs:
            saved = rank_state_of(airs[0])["world_size"]
            for r in self.air_session.ranks_to_load(saved):
                if r not in airs and (a := read(r)) is not None:
                    airs[r] = a
        return airs

    def resume(self) -> int:
        """Load the newest committed checkpoint if there is one; return ``start_epoch`` (0 when fresh).

        Call after ``prepare``; then ``for epoch in range(accelerator.resume(), num_epochs)``. The
        prepared loaders continue where the checkpoint left them, mid-epoch included.
        """
        if self._air.latest() is None:
            logger.info("AirAccelerator: nothing committed under %s; starting fresh", self.air_plugin.root)
            return 0
        self.load_state()
        return self.start_epoch

    # -- MLflow run --------------------------------------------------------------------------
    def _air_tracker_run_id(self) -> str | None:
        tracker = next((t for t in self.trackers if t.name == "mlflow"), None)
        run = getattr(tracker, "active_run", None)
        return run.info.run_id if run is not None else None

    def _air_continue_mlflow_run(self, run_id: str) -> None:
        """Make Accelerate's MLflow tracker log into the checkpoint's run instead of a fresh one."""
        tracker = next((t for t in self.trackers if t.name == "mlflow"), None)
        if tracker is None or not self.is_main_process or self._air_tracker_run_id() == run_id:
            return
        import mlflow

        fresh = self._air_tracker_run_id()
        mlflow.end_run()
        tracker.active_run = mlflow.start_run(run_id=run_id)
        if fresh is not None:
            mlflow.delete_run(fresh)
        logger.info("AirAccelerator: continuing MLflow run %s", run_id)

    # -- shutdown ----------------------------------------------------------------------------
    def wait_for_checkpoints(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed (raises the first failure)."""
        self._air.flush(self.air_plugin.session.flush_timeout_seconds if timeout is None else timeout)

    @override
    def end_training(self) -> None:
        """Commit what is in flight (bounded by ``flush_timeout_seconds``), report goodput and end the
        MLflow run the session started (rank 0), then end the trackers and the process group."""
        self.air_session.close(self.completed_steps)
        super().end_training()
