"""Each private (or undocumented) name of Accelerate that ``accelerate_air`` reads or writes, as a ``Touch``.

Accelerate 1.13 to 1.16 keep what ``prepare`` and ``register_*`` were given on the ``Accelerator``
in underscore lists, with no public property, getter or iterator for them: the stock ``save_state``
and ``load_state`` read those lists directly. ``AirAccelerator`` replaces ``save_state`` and builds
the same files (``layout.py``), so it must read the same lists, in the same order. Checked by reading
the source of 1.13.0, 1.14.0, 1.15.0 and 1.16.0 and by ``tests/accelerate/test_internals.py`` (run against the
installed release; ``.venv-oldest`` has the floor, 1.13.0):

- ``Accelerator._models``, ``_optimizers``, ``_schedulers``, ``_dataloaders``: the prepared objects,
  which ``save_state`` writes as ``pytorch_model_<i>``, ``optimizer_<i>``, ``scheduler_<i>`` and the
  loaders' sampler / ``dl_state_dict`` files by their index here. ``load_state`` loads models and
  optimizers from these lists only, which is why ``hidden`` empties the first two around the stock
  ``load_state`` once the core has loaded FSDP2 shards (the one write).
- ``Accelerator._custom_objects``: what ``register_for_checkpointing`` was given
  (``custom_checkpoint_<i>.pkl``); the method returns nothing that lists them.
- ``Accelerator._save_model_state_pre_hook``: ``register_save_state_pre_hook`` returns only a
  ``RemovableHandle``, and only the stock ``save_state`` calls the hooks; read there (handle id ->
  hook), a removed handle stays removed.

Two public-named but undocumented attributes are replaced on live objects (``accelerator.py``):

- ``DataLoaderAdapter.base_dataloader``: a prepared loader iterates the torch loader it holds there,
  and Accelerate has no hook per fetched batch, so ``prepare_data_loader`` puts the session's
  ``TrackedLoader`` in its place (fetch times, the position per rank).
- ``MLflowTracker.active_run``: set only by the tracker's ``start`` (a new run, or ``MLFLOW_RUN_ID``
  read before any checkpoint is loaded); a resumed job swaps in the checkpoint's run there.

No private method of ``Accelerator`` is overridden (``AirAccelerator``'s own are ``_air_*``).
torchdata's ``StatefulDataLoader`` attributes that ``layout.start_epochs_at_iter`` resets are the
core's touches (``air_core/internals.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from accelerate import Accelerator

from air_core.internals import Touch

_CHECKED = "1.13.0, 1.14.0, 1.15.0 and 1.16.0"


def _accelerate(where: str, why: str) -> Touch:
    return Touch("accelerate", where, _CHECKED, why)


MODELS = _accelerate(
    "Accelerator._models",
    "Accelerator keeps the models prepare() returned only there (no public property), and "
    "save_state/load_state write and read pytorch_model_<i> by their index in it",
)
OPTIMIZERS = _accelerate(
    "Accelerator._optimizers",
    "Accelerator keeps the prepared optimizers only there (no public property), and save_state/"
    "load_state write and read optimizer_<i> by their index in it",
)
SCHEDULERS = _accelerate(
    "Accelerator._schedulers",
    "Accelerator keeps the prepared schedulers only there (no public property), and save_state "
    "writes scheduler_<i> by their index in it",
)
DATALOADERS = _accelerate(
    "Accelerator._dataloaders",
    "Accelerator keeps the prepared data loaders only there (no public property), and save_state "
    "writes their sampler and dl_state_dict files by their index in it",
)
CUSTOM_OBJECTS = _accelerate(
    "Accelerator._custom_objects",
    "register_for_checkpointing keeps its objects only there, and save_state writes "
    "custom_checkpoint_<i>.pkl by their index in it",
)
SAVE_STATE_PRE_HOOKS = _accelerate(
    "Accelerator._save_model_state_pre_hook",
    "register_save_state_pre_hook returns only a handle and only the stock save_state, which "
    "AirAccelerator replaces, calls the hooks it keeps there",
)
BASE_DATALOADER = _accelerate(
    "DataLoaderAdapter.base_dataloader",
    "a prepared loader iterates the torch loader it holds there and Accelerate has no hook per "
    "fetched batch, so AirAccelerator puts the session's tracking loader in its place",
)
MLFLOW_ACTIVE_RUN = _accelerate(
    "MLflowTracker.active_run",
    "only the tracker's start() sets its run, before a resumed checkpoint names one, so a resumed "
    "job swaps the checkpoint's run in there",
)


def _listed(touch: Touch, accelerator: Accelerator) -> list[Any]:
    """The live list ``touch`` names on ``accelerator`` (not to be modified)."""
    value = touch.get(accelerator)
    if not isinstance(value, list):
        raise touch.broken(f"a {type(value).__name__}, not a list of the prepared objects")
    return value


def models(accelerator: Accelerator) -> list[Any]:
    """The prepared models, in ``prepare`` order (Accelerate's ``pytorch_model_<i>``)."""
    return _listed(MODELS, accelerator)


def optimizers(accelerator: Accelerator) -> list[Any]:
    """The prepared optimizers (``AcceleratedOptimizer``), in ``prepare`` order."""
    return _listed(OPTIMIZERS, accelerator)


def schedulers(accelerator: Accelerator) -> list[Any]:
    """The prepared schedulers (``AcceleratedScheduler``), in ``prepare`` order."""
    return _listed(SCHEDULERS, accelerator)


def dataloaders(accelerator: Accelerator) -> list[Any]:
    """The prepared data loaders, in ``prepare`` order."""
    return _listed(DATALOADERS, accelerator)


def custom_objects(accelerator: Accelerator) -> list[Any]:
    """The objects given to ``register_for_checkpointing``, in that order."""
    return _listed(CUSTOM_OBJECTS, accelerator)


def save_state_pre_hooks(accelerator: Accelerator) -> list[Callable[..., None]]:
    """The hooks ``register_save_state_pre_hook`` holds now (removed ones excluded), in that order."""
    hooks = SAVE_STATE_PRE_HOOKS.get(accelerator)
    if not isinstance(hooks, Mapping):
        raise SAVE_STATE_PRE_HOOKS.broken(f"a {type(hooks).__name__}, not a mapping of handle id -> hook")
    return list(hooks.values())


@contextlib.contextmanager
def hidden(accelerator: Accelerator, *touches: Touch) -> Iterator[None]:
    """Empty the lists ``touches`` name on ``accelerator`` for the duration (restored even on an
    exception), so the stock ``load_state`` skips what the core already loaded."""
    saved = [(touch, _listed(touch, accelerator)) for touch in touches]
    try:
        for touch, _ in saved:
            touch.set(accelerator, [])
        yield
    finally:
        for touch, value in saved:
            touch.set(accelerator, value)
