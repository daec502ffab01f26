"""Each private name of Accelerate that accelerate_air relies on still holds in the installed release.

One test per ``Touch`` of ``accelerate_air/internals.py``, on a real ``Accelerator(cpu=True)``: a
release that renames or reshapes one fails here with the touch's own message (name, installed and
checked versions), before any save does. ``.venv-oldest`` runs them against the floor (1.13.0).
"""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader, TensorDataset

from accelerate_air import internals
from air_core import AirError
from tests.accelerate.test_accelerator import Counter


@pytest.fixture(autouse=True)
def fresh_state():
    """What Accelerate's own test case does between tests: no state left by an earlier Accelerator."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield


def prepared(accelerator: Accelerator):
    """Two models, an optimizer, a scheduler and a loader, prepared (as ``save_state`` would see them)."""
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(first.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
    return accelerator.prepare(first, second, optimizer, scheduler, loader)


def test_models_lists_the_prepared_models_in_prepare_order():
    accelerator = Accelerator(cpu=True)
    first, second, *_ = prepared(accelerator)
    assert internals.models(accelerator) == [first, second]


def test_optimizers_lists_the_prepared_optimizers():
    accelerator = Accelerator(cpu=True)
    _, _, optimizer, _, _ = prepared(accelerator)
    assert internals.optimizers(accelerator) == [optimizer]


def test_schedulers_lists_the_prepared_schedulers():
    accelerator = Accelerator(cpu=True)
    _, _, _, scheduler, _ = prepared(accelerator)
    assert internals.schedulers(accelerator) == [scheduler]


def test_dataloaders_lists_the_prepared_loaders():
    accelerator = Accelerator(cpu=True)
    *_, loader = prepared(accelerator)
    assert internals.dataloaders(accelerator) == [loader]


def test_custom_objects_lists_what_register_for_checkpointing_got():
    accelerator = Accelerator(cpu=True)
    first, second = Counter(), Counter()
    accelerator.register_for_checkpointing(first, second)
    assert internals.custom_objects(accelerator) == [first, second]


def test_save_state_pre_hooks_holds_registered_hooks_until_removed():
    accelerator = Accelerator(cpu=True)

    def hook(models, weights, output_dir):
        pass

    handle = accelerator.register_save_state_pre_hook(hook)
    assert internals.save_state_pre_hooks(accelerator) == [hook]
    handle.remove()
    assert internals.save_state_pre_hooks(accelerator) == [], "a removed hook is not called"


def test_hidden_models_and_optimizers_are_skipped_by_stock_load_state_and_restored(tmp_path):
    accelerator = Accelerator(cpu=True)
    model, _, optimizer, _, _ = prepared(accelerator)
    accelerator.save_state(str(tmp_path / "ckpt"))
    changed = {k: v + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(changed)
    with pytest.raises(RuntimeError, match="inside"):
        with internals.hidden(accelerator, internals.MODELS, internals.OPTIMIZERS):
            accelerator.load_state(str(tmp_path / "ckpt"))
            assert internals.models(accelerator) == [] and internals.optimizers(accelerator) == []
            raise RuntimeError("inside")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in changed.items()), "not loaded"
    assert internals.models(accelerator)[0] is model, "restored on an exception"
    assert internals.optimizers(accelerator) == [optimizer]


def test_base_dataloader_is_what_a_prepared_loader_iterates():
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2))
    base = internals.BASE_DATALOADER.get(loader)
    assert isinstance(base, DataLoader)
    seen: list[list[float]] = []

    class Watched:  # as the session's TrackedLoader: the loader's attributes, its batches seen
        def __getattr__(self, name: str):
            return getattr(base, name)

        def __len__(self) -> int:
            return len(base)

        def __iter__(self):
            for batch in base:
                seen.append(batch[0].tolist())
                yield batch

    internals.BASE_DATALOADER.set(loader, Watched())
    assert [b[0].tolist() for b in loader] == seen == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_mlflow_active_run_is_the_run_the_tracker_logs_to(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    accelerator = Accelerator(cpu=True, log_with="mlflow", project_dir=str(tmp_path))
    accelerator.init_trackers("internals")
    try:
        tracker = accelerator.get_tracker("mlflow", unwrap=False)
        run = internals.MLFLOW_ACTIVE_RUN.get(tracker)
        assert run.info.run_id == mlflow.active_run().info.run_id
    finally:
        accelerator.end_training()


def test_a_renamed_attribute_fails_naming_it_and_the_checked_releases():
    with pytest.raises(AirError) as caught:
        internals.models(object())  # type: ignore[arg-type]
    message = str(caught.value)
    assert "Accelerator._models" in message and "1.13.0" in message and "1.16.0" in message
