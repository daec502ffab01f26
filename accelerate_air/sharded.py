"""FSDP2 sharded state for ``AirAccelerator``: Accelerate's own DCP folders, saved and loaded by the core.

Accelerate 1.15 saves an FSDP2 model whose ``state_dict_type`` is ``SHARDED_STATE_DICT`` as DCP folders
``pytorch_model_fsdp_<i>`` (``{"model": ...}``) and ``optimizer_<i>`` (``{"optimizer": ...}``), each with
a synchronous ``FileSystemWriter``. Here the same folders, with the same keys, are one commit of the
core (``air_core.dcp``: snapshot into host buffers, background persist, all ranks' files committed
together), so a downloaded checkpoint still loads with a stock ``Accelerator.load_state``; loads go
through the core's reader, so each rank fetches only the files it needs, at any world size.
Getting, loading and setting the sharded state is ``air_core.dcp``'s (no CPU copy: the snapshot is the
one copy); here only Accelerate's folders and keys, and its optimizer wrapper.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME

from air_core import AsyncCheckpointer, CheckpointInfo, dcp


def fsdp2_sharded(accelerator: Accelerator) -> bool:
    """Whether ``accelerator`` runs FSDP2 with sharded state dicts (the one FSDP setup handled here)."""
    if not accelerator.is_fsdp2:  # public since before 1.13, the floor
        return False
    kind = accelerator.state.fsdp_plugin.state_dict_type
    return str(getattr(kind, "name", kind)).upper().endswith("SHARDED_STATE_DICT")


def model_folder(folder: str, i: int) -> str:
    """The ``i``-th model's DCP folder in checkpoint folder ``folder`` (Accelerate's name for it;
    ``folder == ""``: at the root's top)."""
    return f"{folder}/{FSDP_MODEL_NAME}_{i}" if folder else f"{FSDP_MODEL_NAME}_{i}"


def optimizer_folder(folder: str, i: int) -> str:
    """The ``i``-th optimizer's DCP folder in checkpoint folder ``folder`` (Accelerate's name for it)."""
    return f"{folder}/{OPTIMIZER_NAME}_{i}" if folder else f"{OPTIMIZER_NAME}_{i}"


def _raw(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # an AcceleratedOptimizer wraps the torch one


def _folders(folder: str, models: list[Any], optimizers: list[Any]) -> dict[str, dcp.ShardedState]:
    """Folder -> what it holds: ``{"model": ...}`` per model, then ``{"optimizer": ...}`` per optimizer
    (optimizer ``i`` belongs to model ``i``, as Accelerate pairs them)."""
    folders = {model_folder(folder, i): dcp.ShardedState(m, "model") for i, m in enumerate(models)}
    for i, opt in enumerate(optimizers):
        folders[optimizer_folder(folder, i)] = dcp.ShardedState(models[i], None, {"optimizer": _raw(opt)})
    return folders


def sharded_folders(folder: str, models: list[Any], optimizers: list[Any]) -> dict[str, dict[str, Any]]:
    """Folder -> state dict of every model and optimizer, DTensor shards as they live on the device."""
    return {path: target.state_dict() for path, target in _folders(folder, models, optimizers).items()}


def load_sharded(
    checkpointer: AsyncCheckpointer,
    info: CheckpointInfo,
    models: list[Any],
    optimizers: list[Any],
    *,
    folder: str | None = None,
) -> None:
    """Load every model's and optimizer's shards of ``info`` in place (every rank; DCP reshards).
    ``folder``: the checkpoint's folder under the root (default: its name)."""
    folder = info.name if folder is None else folder
    for path, target in _folders(folder, models, optimizers).items():  # models first, as Accelerate
        dcp.load_into(checkpointer, info, target, folder=path)
