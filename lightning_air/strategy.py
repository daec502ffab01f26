"""``AirModelParallelStrategy`` and ``AirFSDPStrategy``: Lightning's sharded strategies with their sharded
saves through the core.

Lightning's sharded strategies call ``torch.distributed.checkpoint.save`` themselves, synchronously, to a
local folder, after a full CPU copy (``cpu_offload=True``/``offload_to_cpu=True``); their ``CheckpointIO``
is never called for a sharded save (only ``remove_checkpoint`` is). The smallest hook that changes that
is the strategy: these subclasses override only the state-dict methods (no CPU copy: the core's
snapshot is the one copy, into reused host buffers) and ``save_checkpoint``/``load_checkpoint``, which
hand the sharded state to ``AirCheckpointIO`` (``air_core.dcp``): asynchronous, staged, committed across
ranks, to any fsspec ``dirpath``. The folder Lightning chose holds the stock layout (DCP files +
``meta.pt``), so stock Lightning and stock DCP read a downloaded copy. ``ModelCheckpoint`` top-k,
``save_last`` and removal work as for unsharded models: removal already goes through the
``CheckpointIO``. Getting and setting the sharded state is ``air_core.dcp``'s (``model_state``,
``optimizer_state``, ``ShardedState``: FSDP2 DTensors and FSDP1 ``ShardedTensor``s alike); here only
Lightning's keys (``state_dict``/``model``, ``optimizer_<i>``) and its optimizer wrapper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, ParallelStrategy
from torch.optim import Optimizer
from typing_extensions import override

from air_core import ConfigError
from air_core import dcp as air_dcp
from air_core.session import TrainingSession

from .checkpoint_io import NEWEST, AirCheckpointIO, unresolved_newest
from .internals import CONFIGURE_LAUNCHER, METADATA_FILENAME, saves_sharded_itself

if TYPE_CHECKING:
    _Strategy = ParallelStrategy  # what the mixin is mixed into, for the type checker
else:
    _Strategy = object


def _torch_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer a ``LightningOptimizer`` wraps (``optimizer`` itself otherwise)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _optimizer_key(i: int) -> str:
    """Optimizer ``i``'s key in Lightning's sharded folder (stock ``ModelParallelStrategy``'s and
    ``FSDPStrategy``'s)."""
    return f"optimizer_{i}"


class _AirShardedSaves(_Strategy):
    """What both strategies override, over the Lightning strategy they are mixed into.

    ``_air_model_key``: the key Lightning's stock layout gives the model in the DCP folder;
    ``_air_sharded``: whether this strategy's saves are sharded (otherwise Lightning's own path, which
    already goes through the ``CheckpointIO``).
    """

    _air_model_key: str

    @property
    def _air_sharded(self) -> bool:
        raise NotImplementedError

    @property
    def air_io(self) -> AirCheckpointIO:
        plugin = self.checkpoint_io
        if not isinstance(plugin, AirCheckpointIO):
            raise ConfigError(
                f"{type(self).__name__} saves through AirCheckpointIO; found {type(plugin).__name__}. "
                "Pass Trainer(plugins=[lightning_air.AirCheckpointIO(...)])."
            )
        return plugin

    @override
    def setup(self, trainer: Any) -> None:
        _ = self.air_io  # before any training step: a wrong plugin is a ConfigError, not a lost save
        super().setup(trainer)

    def _air_span_ranks(self) -> AirCheckpointIO:
        """The plugin, its session spanning this strategy's ranks (every rank makes each sharded save)."""
        plugin = self.air_io
        if plugin.session.world_size != self.world_size:  # not the fit's (AirCallback's): the plugin's own
            session = TrainingSession.saves_only(
                "AirCheckpointIO",
                plugin.config,
                listeners=plugin.listeners,
                rank=self.global_rank,
                world_size=self.world_size,
                broadcast=lambda value: self.broadcast(value, src=0),
            )
            plugin.use(session)
        return plugin

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._air_sharded:
            return super().lightning_module_state_dict()
        assert self.model is not None
        return air_dcp.model_state(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._air_sharded:
            return super().optimizer_state(optimizer)
        assert self.model is not None
        return air_dcp.optimizer_state(self.model, _torch_optimizer(optimizer))

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Every rank: snapshot its shards into the commit of ``filepath`` (a folder) and return. A full
        save: rank 0 hands the one file to the plugin, as Lightning does, but with the path as given
        (Lightning's own turns it into a ``pathlib.Path``, and ``s3://b/x`` into a local ``s3:/b/x``)."""
        if not self._air_sharded:
            path = str(self.broadcast(str(filepath)))
            if self.is_global_zero:
                self.air_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return None
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported: pass "
                "storage_options to AirCheckpointIO(storage_options=...) instead."
            )
        sharded, rest = split_sharded(self, checkpoint)
        self._air_span_ranks().save_sharded(
            sharded, rest, str(self.broadcast(str(filepath))), meta_file=METADATA_FILENAME.imported()
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint this plugin committed loads through it (resharded at any world size); a
        full file it committed, as Lightning loads it from a verified local copy; anything else as
        Lightning loads it."""
        if str(checkpoint_path) == NEWEST:  # AirCallback resolves it before Lightning loads it
            raise unresolved_newest()
        # NEWEST from the local tier names each rank's own assembly (every rank or none: they agreed)
        resumed = self.air_io.resume_of(str(checkpoint_path))
        path = str(checkpoint_path) if resumed is not None else str(self.broadcast(str(checkpoint_path)))
        if self._air_sharded:
            self._air_span_ranks()
        info = self.air_io.commit_of(path)
        if not self.air_io.is_sharded(info, path):  # Lightning reads a full file itself: from a verified copy
            local = self.air_io.local_copy(path, info, weights_only, resumed)
            return super().load_checkpoint(local, weights_only)
        assert info is not None
        assert self.model is not None and self.lightning_module is not None
        target = air_dcp.ShardedState(
            self.model,
            self._air_model_key,
            {_optimizer_key(i): _torch_optimizer(o) for i, o in enumerate(self.optimizers)},
            strict=self.lightning_module.strict_loading,
        )
        state = target.state_dict()
        checkpoint = self.air_io.load_sharded(
            path,
            info,
            state,
            meta_file=METADATA_FILENAME.imported(),
            weights_only=weights_only,
            resumed=resumed,
        )
        target.load_state_dict(state)
        return checkpoint


def split_sharded(strategy: object, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint dict of a sharded strategy as its stock layout splits it: the DCP state (the
    model under the strategy's key, ``optimizer_<i>``) and the rest (``meta.pt``). ``checkpoint`` is
    emptied of the DCP state."""
    assert isinstance(strategy, _AirShardedSaves)
    sharded = {strategy._air_model_key: checkpoint.pop("state_dict")}
    sharded.update({_optimizer_key(i): s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    return sharded, checkpoint


def saves_sharded(strategy: object) -> bool:
    """Whether ``strategy`` is ours and its saves are sharded: every rank then saves its own part."""
    return isinstance(strategy, _AirShardedSaves) and strategy._air_sharded


class AirModelParallelStrategy(_AirShardedSaves, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 / DTensor) whose sharded checkpoints are saved and loaded by
    ``AirCheckpointIO``.

    Same arguments as ``ModelParallelStrategy``; use it with ``plugins=[AirCheckpointIO(...)]``.
    ``save_distributed_checkpoint=False`` (one full file from rank 0) already goes through the
    ``CheckpointIO`` and is left as Lightning does it.
    """

    _air_model_key = "state_dict"

    @property
    def _air_sharded(self) -> bool:
        return saves_sharded_itself(self)


class AirFSDPStrategy(_AirShardedSaves, FSDPStrategy):
    """``FSDPStrategy`` (FSDP1, GPUs only) whose ``state_dict_type="sharded"`` checkpoints are saved and
    loaded by ``AirCheckpointIO``.

    Same arguments as ``FSDPStrategy``; use it with ``plugins=[AirCheckpointIO(...)]``.
    ``state_dict_type="full"`` (one full file from rank 0) already goes through the ``CheckpointIO``.
    """

    _air_model_key = "model"

    @property
    def _air_sharded(self) -> bool:
        return saves_sharded_itself(self)

    @override
    def _configure_launcher(self) -> None:
        # The Trainer refuses FSDPStrategy on CPU, but only the class itself, not a subclass: refuse here,
        # when the Trainer is built, rather than fail inside torch when the model is wrapped.
        if isinstance(self.accelerator, CPUAccelerator):
            raise ConfigError(
                "AirFSDPStrategy: FSDP (FullyShardedDataParallel) needs GPUs, and the Trainer's accelerator "
                "is the CPU. Pass accelerator='gpu', or on CPU use lightning_air.AirModelParallelStrategy "
                "(FSDP2, fully_shard), which runs with gloo."
            )
        CONFIGURE_LAUNCHER.get(super())()
