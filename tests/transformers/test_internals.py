"""Each private name of transformers that transformers_air relies on still holds in the installed release.

A release that renames or reshapes one fails here with the touch's own message (name, installed and
checked versions), before any save does.
"""

from __future__ import annotations

import inspect

import pytest
from transformers import Trainer

from air_core import AirError
from transformers_air import internals


def test_the_overridden_private_methods_keep_their_parameters():
    internals.check_methods(Trainer)


def test_a_changed_method_fails_naming_itself():
    class Renamed(Trainer):
        def _save_checkpoint(self, model, trial, extra):  # a new parameter
            pass

    with pytest.raises(AirError, match=r"Trainer\._save_checkpoint.*parameters"):
        internals.check_methods(Renamed)


@pytest.mark.parametrize(
    "touch",
    [
        internals.SKIP_FIRST_BATCHES,
        internals.SAFE_SAVE_FILE,
        internals.TRAINER_SAVE_FILE,
        internals.SORT_CHECKPOINTS,
    ],
)
def test_the_replaced_module_functions_are_there_and_called_as_expected(touch):
    module, name = internals.module_function(touch)
    params = list(inspect.signature(getattr(module, name)).parameters)
    expected = {
        "skip_first_batches": ["dataloader", "num_batches"],
        "safe_save_file": ["tensors", "filename"],
        "save_file": ["tensors", "filename"],
        "sort_checkpoints": ["output_dir", "checkpoint_prefix"],
    }
    assert params[:2] == expected[name]


def test_save_pretrained_writes_its_shards_through_safe_save_file():
    """The capture in layout.model_files relies on it (a direct call, not another writer)."""
    from transformers import modeling_utils

    assert "safe_save_file(" in inspect.getsource(modeling_utils.PreTrainedModel.save_pretrained)


def test_trainer_saves_a_plain_module_through_safetensors_save_file():
    """The capture in layout.model_files relies on it for a model that is no PreTrainedModel."""
    assert "safetensors.torch.save_file(" in inspect.getsource(Trainer._save)


def test_mlflow_callback_keeps_whether_it_logs_checkpoint_artifacts():
    """Off until its setup reads HF_MLFLOW_LOG_ARTIFACTS (AirTrainer saves only after that)."""
    from transformers.integrations import MLflowCallback

    assert internals.MLFLOW_LOG_ARTIFACTS.get(MLflowCallback()) is False
