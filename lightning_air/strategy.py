"""``AirModelParallelStrategy``: Lightning's FSDP2/DTensor strategy with its sharded saves through the core.

Lightning's sharded strategies call ``torch.distributed.checkpoint.save`` themselves, synchronously, to a
local folder, after a full CPU copy (``cpu_offload=True``); their ``CheckpointIO`` is never called for a
sharded save (only ``remove_checkpoint`` is). The smallest hook that changes that is the strategy: this
subclass overrides only the state-dict methods (no CPU copy: the core's snapshot is the one copy, into
reused host buffers) and ``save_checkpoint``/``load_checkpoint``, which hand the sharded state to
``AirCheckpointIO`` (``air_core.dcp``): asynchronous, staged, committed across ranks, to any fsspec
``dirpath``. The folder Lightning chose holds the stock layout (DCP files + ``meta.pt``), so stock
Lightning and stock DCP read a downloaded copy. ``ModelCheckpoint`` top-k, ``save_last`` and removal
work as for unsharded models: removal already goes through the ``CheckpointIO``.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from typing_extensions import override

from air_core import ConfigError

from .checkpoint_io import AirCheckpointIO

_SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=False)


class AirModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose sharded checkpoints are saved and loaded by ``AirCheckpointIO``.

    Same arguments as ``ModelParallelStrategy``; use it with ``plugins=[AirCheckpointIO(...)]``.
    ``save_distributed_checkpoint=False``
    (one full file from rank 0) already goes through the ``CheckpointIO`` and is left as Lightning does it.
    """

    @property
    def air_io(self) -> AirCheckpointIO:
        plugin = self.checkpoint_io
        if not isinstance(plugin, AirCheckpointIO):
            raise ConfigError(
                f"AirModelParallelStrategy saves through AirCheckpointIO; found {type(plugin).__name__}. "
                "Pass Trainer(plugins=[lightning_air.AirCheckpointIO(...)])."
            )
        return plugin

    @override
    def setup(self, trainer: Any) -> None:
        _ = self.air_io  # before any training step: a wrong plugin is a ConfigError, not a lost save
        super().setup(trainer)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().lightning_module_state_dict()
        assert self.model is not None
        return get_model_state_dict(self.model, options=_SHARDED)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return get_optimizer_state_dict(self.model, optimizer, options=_SHARDED)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Every rank: snapshot its shards into the commit of ``filepath`` (a folder) and return."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                "AirModelParallelStrategy.save_checkpoint(storage_options=...) is not supported: pass "
                "storage_options to AirCheckpointIO(storage_options=...) instead."
            )
        sharded = {"state_dict": checkpoint.pop("state_dict")}
        sharded.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        self.air_io.save_sharded(
            sharded, checkpoint, str(self.broadcast(str(filepath))), meta_file=_METADATA_FILENAME
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint this plugin committed loads through it (resharded at any world size);
        anything else as Lightning loads it."""
        path = str(self.broadcast(str(checkpoint_path)))
        if not self.air_io.is_sharded(path):
            return super().load_checkpoint(path, weights_only)
        assert self.model is not None and self.lightning_module is not None
        state: dict[str, Any] = {"state_dict": get_model_state_dict(self.model, options=_SHARDED)}
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        for i, optimizer in enumerate(optimizers):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(self.model, optimizer, options=_SHARDED)
        checkpoint = self.air_io.load_sharded(
            path, state, meta_file=_METADATA_FILENAME, weights_only=weights_only
        )
        self.model.load_state_dict(state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(optimizers):
            set_optimizer_state_dict(
                self.model, optimizer, optim_state_dict=state[f"optimizer_{i}"], options=_SHARDED
            )
        return checkpoint
