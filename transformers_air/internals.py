"""Each private name of transformers that ``transformers_air`` overrides, replaces or reads, as a ``Touch``.

``Trainer`` has callback hooks around a checkpoint save (``on_save``, after it) but none that replaces
how one is written, loaded, or how the data is skipped on resume. ``AirTrainerMixin`` overrides three
private methods where that happens, and replaces four module-level functions on the calls that need it.
Checked by reading the source of transformers 5.24.0 and by ``tests/transformers/test_internals.py`` with
``test_trainer.py`` against 5.2.0 (the floor in ``pyproject.toml``: 5.0 and 5.1 have no module-level
``sort_checkpoints``) and the installed release:

- ``Trainer._save_checkpoint(model, trial)``: the one place a checkpoint folder is written (weights,
  optimizer, scheduler, scaler, RNG, ``trainer_state.json``, rotation), synchronously. Overridden: the
  same files are built in memory and committed in the background (``layout.py``).
- ``Trainer._load_rng_state(checkpoint)``: restores the RNG after the first batches of a resumed epoch
  were fetched; the session puts it back right before that fetch (so draws made while fetching match),
  so the stock restore is skipped for a checkpoint whose position the session restored.
- ``Trainer._load_best_model()``: reads ``state.best_model_checkpoint`` as a local folder; overridden to
  hand it the best commit's verified local copy (the root may be remote).
- ``Trainer._get_output_dir(trial)``: the run folder checkpoints go in (read, as stock does).
- ``transformers.trainer.skip_first_batches``: the module-level function Trainer's epoch loop calls to
  skip the batches a checkpoint consumed. Replaced during ``train()`` by one that leaves the tracked
  train loader to the session (restored: nothing to skip; a stock checkpoint: re-read and dropped, so
  the position counts them) and calls the original for any other loader.
- ``transformers.trainer.sort_checkpoints``: at the end of training with ``save_total_limit=1`` and a
  best checkpoint, Trainer lists the checkpoint folders through it and ``shutil.rmtree`` s all but the
  best. Replaced during ``train()`` by one that does that clean-up through the core under the root
  (``output_dir``, or ``AirTrainerCallback(root=...)``) once every save committed, and lists nothing for
  Trainer to delete.
- ``MLflowCallback._log_artifacts``: whether its ``on_save`` uploads the checkpoint folder (set from
  ``HF_MLFLOW_LOG_ARTIFACTS`` at its setup). A callback that reads the folder in ``on_save`` makes each
  save wait for its commit; this one only when it reads, so ``report_to=["mlflow"]`` stays asynchronous.
- ``transformers.modeling_utils.safe_save_file``: ``save_pretrained`` writes each weight shard through
  it. Replaced only while ``layout.model_files`` runs ``save_model`` into a scratch folder, so the
  shards' tensors are captured (and written later by the writer thread) instead of written.
- ``safetensors.torch.save_file``, as ``Trainer._save`` calls it: a model that is no ``PreTrainedModel``
  has its state dict written through it (``model.safetensors``). Replaced, as above, only while
  ``layout.model_files`` runs, and only for the thread running it.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from air_core.internals import Touch

_CHECKED = "5.2.0 and 5.24.0"


def _transformers(where: str, why: str) -> Touch:
    return Touch("transformers", where, _CHECKED, why)


SAVE_CHECKPOINT = _transformers(
    "Trainer._save_checkpoint",
    "Trainer writes a checkpoint there, synchronously, and no callback hook replaces the write",
)
LOAD_RNG_STATE = _transformers(
    "Trainer._load_rng_state",
    "Trainer restores the RNG there after fetching the resumed epoch's first batches, later than the "
    "point an exact resume needs",
)
LOAD_BEST_MODEL = _transformers(
    "Trainer._load_best_model",
    "Trainer loads the best checkpoint there from a local folder path, and the root may be remote",
)
GET_OUTPUT_DIR = _transformers(
    "Trainer._get_output_dir",
    "it is where Trainer decides the run folder its checkpoints go in",
)
SKIP_FIRST_BATCHES = _transformers(
    "transformers.trainer.skip_first_batches",
    "Trainer's epoch loop skips a resumed epoch's consumed batches through it, with no hook to say the "
    "loader already continues after them",
)
SORT_CHECKPOINTS = _transformers(
    "transformers.trainer.sort_checkpoints",
    "Trainer's end-of-training clean-up lists the folders it deletes through it, with no hook before",
)
SAFE_SAVE_FILE = _transformers(
    "transformers.modeling_utils.safe_save_file",
    "save_pretrained writes each weight shard through it, and has no option that returns the shards "
    "instead of writing them",
)
TRAINER_SAVE_FILE = _transformers(
    "safetensors.torch.save_file",
    "Trainer._save writes the state dict of a model that is no PreTrainedModel through it, with no "
    "option that returns the tensors instead of writing them",
)

MLFLOW_LOG_ARTIFACTS = _transformers(
    "MLflowCallback._log_artifacts",
    "MLflowCallback keeps whether its on_save uploads the checkpoint folder only there",
)

OVERRIDDEN = {
    SAVE_CHECKPOINT: ("self", "model", "trial"),
    LOAD_RNG_STATE: ("self", "checkpoint"),
    LOAD_BEST_MODEL: ("self",),
    GET_OUTPUT_DIR: ("self", "trial"),
}
"""Each overridden or called private method -> the parameters it is checked to take."""


def check_methods(trainer_class: type) -> None:
    """Raise the touch's error if a private method this package overrides or calls changed shape."""
    for touch, params in OVERRIDDEN.items():
        method = touch.get(trainer_class)
        found = tuple(inspect.signature(method).parameters)
        if found != params:
            raise touch.broken(f"its parameters are {found}, not {params}")


def module_function(touch: Touch) -> tuple[Any, str]:
    """The module a module-level touch lives in, and the function's name there (checked present)."""
    module_name, name = touch.where.rsplit(".", 1)
    module = importlib.import_module(module_name)
    touch.get(module)
    return module, name
