"""A framework's sharded model and optimizers, got and set once for every adapter.

``model_state``/``optimizer_state`` give each rank's shards as they live (no gather, no CPU copy: the
snapshot is the one copy); ``ShardedState`` says which key of a DCP folder holds the model and which
each optimizer (``api.load_into`` fills them from a commit). An adapter only names its keys and folders
and passes the raw torch objects (its optimizer wrapper unwrapped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..errors import ConfigError

SHARDED_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False)
"""How sharded state dicts are got and set: each rank's own shards (DTensors of FSDP2 ``fully_shard``,
``ShardedTensor``s of FSDP1), no full gather and no CPU copy (the snapshot is the one copy)."""


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """``model``'s sharded state dict: references to this rank's shards of its parameters and buffers."""
    return get_model_state_dict(model, options=SHARDED_OPTIONS)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s sharded state dict (keyed by ``model``'s parameter names), references to this
    rank's shards. ``optimizer`` is the torch one (a framework's wrapper unwrapped by its adapter)."""
    return cast(dict[str, Any], get_optimizer_state_dict(model, optimizer, options=SHARDED_OPTIONS))


@dataclasses.dataclass(frozen=True)
class ShardedState:
    """What one DCP folder's state dict holds, as a framework lays it out: ``model``'s sharded state under
    ``model_key`` (None: the folder holds no model state) and each optimizer's under its key.

    Lightning's folder: ``ShardedState(model, "state_dict", {"optimizer_0": opt})``; Accelerate's
    ``pytorch_model_fsdp_0``: ``ShardedState(model)``, its ``optimizer_0``:
    ``ShardedState(model, None, {"optimizer": opt})`` (optimizer state is keyed by the model's names).

    Args:
        model: the sharded (FSDP2 or FSDP1) module.
        model_key: the key of its state in the folder.
        optimizers: key -> torch optimizer over ``model``'s parameters.
        strict: whether the model's keys must match the loaded ones exactly (``load_state_dict``).
    """

    model: torch.nn.Module
    model_key: str | None = "model"
    optimizers: Mapping[str, torch.optim.Optimizer] = dataclasses.field(default_factory=dict)
    strict: bool = True

    def __post_init__(self) -> None:
        if self.model_key is None and not self.optimizers:
            raise ConfigError("ShardedState(model_key=None, optimizers={}): the folder would hold nothing.")
        if self.model_key in self.optimizers:
            raise ConfigError(
                f"ShardedState(model_key={self.model_key!r}): the key also names an optimizer "
                f"({sorted(self.optimizers)})."
            )

    def state_dict(self) -> dict[str, Any]:
        """The folder's state dict, each value a fresh sharded state dict of the live shards (save it, or
        load into it in place and pass it to ``load_state_dict``)."""
        state: dict[str, Any] = {} if self.model_key is None else {self.model_key: model_state(self.model)}
        state.update({key: optimizer_state(self.model, o) for key, o in self.optimizers.items()})
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set the model (``strict`` as given), then each optimizer, from ``state`` (``state_dict``'s
        layout, loaded)."""
        if self.model_key is not None:
            options = dataclasses.replace(SHARDED_OPTIONS, strict=self.strict)
            set_model_state_dict(self.model, state[self.model_key], options=options)
        for key, optimizer in self.optimizers.items():
            set_optimizer_state_dict(
                self.model, optimizer, optim_state_dict=cast(Any, state[key]), options=SHARDED_OPTIONS
            )
