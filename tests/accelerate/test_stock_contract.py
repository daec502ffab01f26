"""AirAccelerator keeps Accelerate's own save_state/load_state contract (issue 15): where checkpoints go,
what a load reads right after a save, save hooks, foreign folders, the documented resume recipe."""

from __future__ import annotations

import json
import logging
import os
import pickle
import stat

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from safetensors import safe_open
from torch.utils.data import DataLoader, TensorDataset

from accelerate_air import AirAccelerator, AirPlugin
from air_core import AirError, AsyncCheckpointer, ConfigError, CorruptCheckpointError
from tests.accelerate.test_accelerator import Counter, air, setup, train


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(model.state_dict()[k], v) for k, v in want.items())


def committed_names(root: str) -> list[str]:
    with AsyncCheckpointer(root, read_only=True) as ckpt:
        return [i.name for i in ckpt.list() if i.status == "committed"]


def test_load_right_after_save_reads_the_save_just_made(tmp_path):
    accelerator = air(str(tmp_path / "root"))
    model, optimizer, loader, scheduler, counter = setup(accelerator)
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=2)
    accelerator.save_state()
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=2)
    accelerator.save_state()  # in flight when the load below starts: the load waits for it
    want = weights(model)
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=2)
    accelerator.load_state()
    assert same(model, want) and accelerator.completed_steps == 4, "the newest save, not the one before"
    accelerator.end_training()


def test_save_into_a_folder_holding_a_stock_checkpoint_never_loads_the_stale_files(tmp_path):
    folder = tmp_path / "ckpt"
    stock = Accelerator(cpu=True)
    stock_model = setup(stock, seed=5)[0]
    stock.save_state(str(folder))  # model.safetensors: Accelerate prefers it to pytorch_model.bin
    stale = weights(stock_model)
    accelerator = air(str(tmp_path / "root"))
    model, optimizer, loader, scheduler, counter = setup(accelerator)
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=3)
    assert accelerator.save_state(str(folder)) == str(folder)
    want = weights(model)
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=2)
    accelerator.load_state(str(folder))
    assert same(model, want) and not same(model, stale), "our commit, not the stock files left in the folder"
    assert accelerator.completed_steps == 3
    accelerator.end_training()


def test_stock_load_state_of_a_folder_saved_by_stock_then_by_air_reads_the_air_weights(tmp_path):
    """A stock save's ``model.safetensors`` left in the folder must not win, in a stock ``load_state``,
    over the weights of a later AirAccelerator save: stock prefers safetensors, so ours are safetensors
    too (the default ``safe_serialization=True``), written over the stale file."""
    folder = tmp_path / "ckpt"
    stock = Accelerator(cpu=True)
    stale = weights(setup(stock, seed=5)[0])
    stock.save_state(str(folder))
    accelerator = air(str(tmp_path / "root"))
    model, optimizer, loader, scheduler, counter = setup(accelerator)
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=3)
    accelerator.save_state(str(folder))
    want, want_opt = weights(model), optimizer.state_dict()["state"][0]["exp_avg"].clone()
    accelerator.end_training()
    reader = Accelerator(cpu=True)
    model2, optimizer2, *_ = setup(reader, seed=1)
    reader.load_state(str(folder))
    assert same(model2, want) and not same(model2, stale), "the weights AirAccelerator saved, not stale ones"
    assert torch.equal(optimizer2.state_dict()["state"][0]["exp_avg"], want_opt), "with their optimizer"


def test_a_torch_format_checkpoint_as_earlier_versions_wrote_resumes_and_loads_with_stock(tmp_path):
    """``safe_serialization=False`` writes ``pytorch_model.bin``, the only layout of earlier versions:
    ``resume()`` and a stock ``load_state`` both read it."""
    accelerator = air(str(tmp_path / "root"))
    model, optimizer, loader, scheduler, counter = setup(accelerator)
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=3)
    url = accelerator.save_state(safe_serialization=False)
    want = weights(model)
    accelerator.end_training()
    assert {"pytorch_model.bin", "model.safetensors"} & set(os.listdir(url)) == {"pytorch_model.bin"}
    resumed = air(str(tmp_path / "root"))
    model2, optimizer2, loader2, scheduler2, counter2 = setup(resumed, seed=1)
    resumed.resume()
    assert same(model2, want) and resumed.completed_steps == 3, "resume() reads pytorch_model.bin"
    resumed.end_training()
    stock = Accelerator(cpu=True)
    model3 = setup(stock, seed=2)[0]
    stock.load_state(url)
    assert same(model3, want), "a stock load_state reads it too"


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode, self.decode = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.decode.weight = self.encode.weight  # tied, as a language model's embedding and head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(torch.relu(self.encode(x)))


def test_tied_weights_are_saved_as_stock_saves_them_and_load_back_tied(tmp_path):
    """Safetensors holds a shared tensor once (Accelerate drops the alias): the same keys as a stock save,
    and both loads accept the file and give the tied model its weights."""
    torch.manual_seed(0)
    stock = Accelerator(cpu=True)
    stock.prepare(_Tied())
    stock.save_state(str(tmp_path / "stock"))
    accelerator = air(str(tmp_path / "root"))
    model = accelerator.prepare(_Tied())
    with torch.no_grad():
        model.encode.weight.add_(1.0)
    url = accelerator.save_state()
    want = weights(model)
    accelerator.wait_for_checkpoints()
    with (
        safe_open(f"{url}/model.safetensors", "pt") as ours,
        safe_open(f"{tmp_path}/stock/model.safetensors", "pt") as theirs,
    ):
        assert set(ours.keys()) == set(theirs.keys()), "the keys a stock save writes"  # noqa: SIM118
        assert ours.metadata() == theirs.metadata()
    accelerator.load_state(url)  # the model check accepts the dropped alias
    assert same(model, want) and model.decode.weight is model.encode.weight
    accelerator.end_training()
    reader = Accelerator(cpu=True)
    model2 = reader.prepare(_Tied())
    reader.load_state(url)
    assert same(model2, want) and model2.decode.weight is model2.encode.weight


def test_saving_a_folder_twice_replaces_it_and_load_reads_the_second(tmp_path):
    for folder in (tmp_path / "elsewhere" / "state", tmp_path / "root" / "state"):  # own root; root's folder
        accelerator = air(str(tmp_path / "root"))
        model, optimizer, loader, scheduler, counter = setup(accelerator)
        train(accelerator, model, optimizer, loader, scheduler, counter, steps=2)
        accelerator.save_state(str(folder))
        train(accelerator, model, optimizer, loader, scheduler, counter, steps=2)
        accelerator.save_state(str(folder))
        second = weights(model)
        train(accelerator, model, optimizer, loader, scheduler, counter, steps=2)
        accelerator.load_state(str(folder))
        assert same(model, second) and accelerator.completed_steps == 4, f"the second save of {folder}"
        accelerator.end_training()
        owners = committed_names(str(folder) if "elsewhere" in str(folder) else str(tmp_path / "root"))
        assert len(owners) == 1, f"the first commit of {folder} was retired: {owners}"
        stock = Accelerator(cpu=True)
        stock_model = setup(stock, seed=3)[0]
        stock.load_state(str(folder))
        assert same(stock_model, second), "the folder still loads with stock Accelerate"


def test_automatic_checkpoint_naming_and_total_limit_are_honoured(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = AirAccelerator(
        air_plugin=AirPlugin(str(tmp_path / "checkpoints")), project_config=config, cpu=True
    )
    model, optimizer, loader, scheduler, counter = setup(accelerator)
    for _ in range(4):
        train(accelerator, model, optimizer, loader, scheduler, counter, steps=1)
        where = accelerator.save_state()
    assert where == str(tmp_path / "checkpoints" / "checkpoint_3")
    accelerator.end_training()  # retention runs after each commit, before the writer stops
    assert sorted(committed_names(str(tmp_path / "checkpoints"))) == ["checkpoint_2", "checkpoint_3"]
    assert not (tmp_path / "checkpoints" / "checkpoint_0").exists(), "total_limit is the retention"
    with pytest.raises(ConfigError, match="project_dir/checkpoints"):
        AirAccelerator(air_plugin=AirPlugin(str(tmp_path / "other")), project_config=config, cpu=True)
    with pytest.raises(ConfigError, match="total_limit"):
        AirAccelerator(
            air_plugin=AirPlugin(str(tmp_path / "checkpoints"), keep_last=5), project_config=config, cpu=True
        )


def test_files_written_by_save_hooks_are_committed_with_the_checkpoint(tmp_path):
    accelerator = air(str(tmp_path / "root"))
    setup(accelerator)

    def save_config(models, weights, output_dir):  # the diffusers save_pretrained pattern
        os.makedirs(os.path.join(output_dir, "unet"))
        with open(os.path.join(output_dir, "unet", "config.json"), "w") as f:
            json.dump({"hidden": 16}, f)
        weights.pop()  # the hook saved the model itself

    seen = {}

    def load_config(models, input_dir):
        with open(os.path.join(input_dir, "unet", "config.json")) as f:
            seen.update(json.load(f))
        models.pop()

    accelerator.register_save_state_pre_hook(save_config)
    accelerator.register_load_state_pre_hook(load_config)
    folder = tmp_path / "root" / "hooked"
    accelerator.save_state(str(folder))
    accelerator.load_state(str(folder))
    assert seen == {"hidden": 16}, "the hook's file was committed and is there at load"
    accelerator.end_training()
    with AsyncCheckpointer(str(tmp_path / "root"), read_only=True) as ckpt:
        files = {f.path for f in ckpt.latest().manifest.files}
    assert "hooked/unet/config.json" in files and "hooked/pytorch_model.bin" not in files


def test_a_stock_folder_loads_as_stock_unverified_and_untouched(tmp_path, caplog):
    folder = tmp_path / "stock"
    stock = Accelerator(cpu=True)
    want = weights(setup(stock, seed=7)[0])
    stock.save_state(str(folder))
    before = sorted(os.listdir(folder))
    for path in [folder, *folder.iterdir()]:  # a read-only location
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        accelerator = air(str(tmp_path / "root"))
        model = setup(accelerator)[0]
        with caplog.at_level(logging.INFO, logger="accelerate_air"):
            accelerator.load_state(str(folder))
        assert same(model, want), "loaded as stock Accelerate loads it"
        lines = [r.getMessage() for r in caplog.records if "not a committed checkpoint" in r.getMessage()]
        assert len(lines) == 1 and "without verifying" in lines[0]
        assert sorted(os.listdir(folder)) == before, "no lease, no probe, no record written there"
        with pytest.raises(FileNotFoundError, match="missing"):
            accelerator.load_state(str(tmp_path / "missing"))
        accelerator.end_training()
    finally:
        for path in [folder, *folder.iterdir()]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)


def test_an_uncommitted_folder_inside_the_root_is_refused(tmp_path):
    root = tmp_path / "root"
    accelerator = air(str(root))
    setup(accelerator)
    accelerator.save_state(str(root / "broken"))
    accelerator.wait_for_checkpoints()
    (root / ".air" / "broken" / "manifest.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="broken"):
        accelerator.load_state(str(root / "broken"))
    accelerator.end_training()


def ids_loader(
    accelerator: AirAccelerator, **config
) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.arange(24.0)), batch_size=2, shuffle=True)
    return accelerator.prepare(model, optimizer, loader)


def run(accelerator, model, optimizer, loader, save_at: str | None = None) -> list[float]:
    """One epoch; with ``save_at``, ``save_state(save_at)`` after the 5th step, inside the loop (a loop
    left early starts its epoch afresh, as a plain DataLoader does)."""
    seen = []
    for step, (x,) in enumerate(loader, start=1):
        seen += x.tolist()
        model(x[:, None]).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if save_at is not None and step == 5:
            accelerator.save_state(save_at)
    return seen


def test_the_documented_resume_recipe_with_skip_first_batches_sees_every_sample_once(tmp_path, caplog):
    first = air(str(tmp_path / "root"))
    want = run(first, *ids_loader(first), save_at=str(tmp_path / "root" / "mid"))
    first.end_training()
    resumed = air(str(tmp_path / "root"))
    model, optimizer, loader = ids_loader(resumed)
    resumed.load_state(str(tmp_path / "root" / "mid"))
    with caplog.at_level(logging.INFO, logger="accelerate_air"):
        skipped = resumed.skip_first_batches(loader, 5)  # Accelerate's documented recipe
    assert run(resumed, model, optimizer, skipped) == want[10:], "the rest of the uninterrupted run, in order"
    assert sum("no batch is skipped again" in r.getMessage() for r in caplog.records) == 1
    resumed.end_training()


def test_the_documented_recipe_from_a_step_at_an_epochs_last_batch_goes_on_with_the_next_epoch(tmp_path):
    """Accelerate's recipe for a checkpoint named by its step resumes at epoch ``step // len(loader)`` and
    skips ``step % len(loader)`` batches: from a save after an epoch's last batch, the next epoch, none
    skipped. The loader's position (the end of epoch 0) must not give an empty pass there: that epoch
    would be lost."""

    def epochs(accelerator, model, optimizer, loader, first: int, save_at: str = "") -> list[float]:
        seen = []
        for epoch in range(first, 3):
            active = accelerator.skip_first_batches(loader, 0) if epoch == first and not save_at else loader
            for step, (x,) in enumerate(active, start=1):
                seen += x.tolist()
                model(x[:, None]).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                if save_at and epoch == 0 and step == len(loader):
                    accelerator.save_state(save_at)
        return seen

    first = air(str(tmp_path / "root"))
    want = epochs(first, *ids_loader(first), 0, save_at=str(tmp_path / "root" / "step_12"))
    first.end_training()
    resumed = air(str(tmp_path / "root"))
    model, optimizer, loader = ids_loader(resumed)
    resumed.load_state(str(tmp_path / "root" / "step_12"))
    assert len(loader) == 12
    rest = epochs(resumed, model, optimizer, loader, 12 // len(loader))
    assert rest == want[24:], "epochs 1 and 2, in order"
    resumed.end_training()


def test_a_stateful_dispatching_loader_resumes_its_position(tmp_path):
    config = DataLoaderConfiguration(dispatch_batches=True, use_stateful_dataloader=True)

    def make() -> AirAccelerator:
        return AirAccelerator(
            air_plugin=AirPlugin(str(tmp_path / "root")), dataloader_config=config, cpu=True
        )

    first = make()
    want = run(first, *ids_loader(first), save_at=str(tmp_path / "root" / "mid"))
    first.end_training()
    resumed = make()
    model, optimizer, loader = ids_loader(resumed)
    resumed.load_state(str(tmp_path / "root" / "mid"))
    assert run(resumed, model, optimizer, loader) == want[10:]
    resumed.end_training()


def test_prepared_loaders_pickle_and_end_training_releases_the_root(tmp_path):
    AcceleratorState._reset_state(True)  # what Accelerate's own test case does between tests
    GradientState._reset_state()
    accelerator = air(str(tmp_path / "root"))
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2))
    copy = pickle.loads(pickle.dumps(accelerator))
    assert [b[0].tolist() for b in copy._dataloaders[0]] == [b[0].tolist() for b in loader]
    accelerator.save_state()
    accelerator.end_training()
    assert accelerator.air_session.checkpointer is None and accelerator._air.closed
    lease = json.loads((tmp_path / "root" / ".air" / "lease.json").read_text())
    assert lease.get("released"), f"the lease is released at end_training: {lease}"


def test_a_folder_save_state_made_but_never_committed_is_refused_naming_the_newest_committed(tmp_path):
    """A job killed while a ``save_state(folder)`` was still queued leaves the folder the call made, with
    nothing in it; Accelerate's recipe picks the newest folder. It must hear which one to load instead,
    not fail inside torch on a missing ``pytorch_model.bin``."""
    root = tmp_path / "root"
    accelerator = air(str(root))
    setup(accelerator)
    accelerator.save_state(str(root / "step_4"))
    accelerator.wait_for_checkpoints()
    (root / "step_8").mkdir()  # what save_state(root / "step_8") leaves when killed before its save began
    with pytest.raises(CorruptCheckpointError, match=r"step_8.*never committed.*step_4") as refused:
        accelerator.load_state(str(root / "step_8"))
    assert refused.value.reason == "never committed"
    accelerator.end_training()


def test_load_state_with_nothing_committed_raises_what_stock_raises(tmp_path):
    """Stock Accelerate raises ``ValueError`` for ``load_state()`` with nothing to load; a script's ``except
    ValueError`` must catch ours too."""
    accelerator = air(str(tmp_path / "root"))
    setup(accelerator)
    with pytest.raises(ValueError, match=r"no committed checkpoint under .*root.*resume\(\)"):
        accelerator.load_state()
    accelerator.end_training()


def test_resume_before_the_loader_is_prepared_is_refused_before_any_weight_is_loaded(tmp_path):
    first = air(str(tmp_path / "root"))
    model, optimizer, loader, scheduler, counter = setup(first)
    train(first, model, optimizer, loader, scheduler, counter, steps=2)
    first.save_state()
    first.end_training()
    resumed = air(str(tmp_path / "root"))
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    fresh = weights(model)
    resumed.register_for_checkpointing(Counter())
    model = resumed.prepare(model)  # the loader forgotten
    with pytest.raises(ConfigError, match=r"1 prepared data loader.*prepared 0.*prepare\("):
        resumed.resume()
    assert same(model, fresh), "refused before Accelerate copied any weight"
    resumed.end_training()


def test_resume_with_automatic_naming_saves_after_every_folder_already_there(tmp_path):
    """Stock ``load_state`` leaves ``save_iteration`` at 0, so a resumed job's next save meets
    ``checkpoint_0`` (stock says to set it by hand); ``resume()`` restores everything, the next name too,
    past a folder a killed save left (here ``checkpoint_2``, never committed)."""
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)

    def accelerator() -> AirAccelerator:
        return AirAccelerator(
            air_plugin=AirPlugin(str(tmp_path / "checkpoints")), project_config=config, cpu=True
        )

    first = accelerator()
    model, optimizer, loader, scheduler, counter = setup(first)
    for _ in range(2):
        train(first, model, optimizer, loader, scheduler, counter, steps=1)
        first.save_state()
    first.end_training()
    (tmp_path / "checkpoints" / "checkpoint_2").mkdir()
    config.iteration = 0  # a new launch's configuration
    resumed = accelerator()
    model, optimizer, loader, scheduler, counter = setup(resumed)
    resumed.resume()
    assert resumed.completed_steps == 2
    train(resumed, model, optimizer, loader, scheduler, counter, steps=1)
    assert resumed.save_state() == str(tmp_path / "checkpoints" / "checkpoint_3")
    resumed.end_training()
    assert sorted(committed_names(str(tmp_path / "checkpoints"))) == ["checkpoint_1", "checkpoint_3"]


def test_save_state_after_end_training_says_why_and_the_fix(tmp_path):
    accelerator = air(str(tmp_path / "root"))
    setup(accelerator)
    accelerator.end_training()
    with pytest.raises(AirError, match=r"end_training\(\) ended .* build a new AirAccelerator"):
        accelerator.save_state()


def test_resume_over_a_stock_runs_folders_refuses_naming_the_one_to_load(tmp_path):
    """A project switching to air: the root holds only folders stock Accelerate saved (automatic naming).
    ``resume()`` started afresh there, training over that run; it now names the newest, which
    ``load_state(folder)`` loads as stock does."""
    root = str(tmp_path / "checkpoints")

    def config() -> ProjectConfiguration:
        return ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)

    stock = Accelerator(project_config=config(), cpu=True)
    model, optimizer, loader, scheduler, counter = setup(stock)
    for _ in range(3):
        train(stock, model, optimizer, loader, scheduler, counter, steps=2)
        stock.save_state()
    saved = weights(model)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = AirAccelerator(air_plugin=AirPlugin(root), project_config=config(), cpu=True)
    model, optimizer, loader, scheduler, counter = setup(accelerator, seed=1)
    newest = f"{root}/checkpoint_2"
    with pytest.raises(
        ValueError, match=rf"without it left Accelerate checkpoints.*load_state\('{newest}'\)"
    ):
        accelerator.resume()
    with pytest.raises(
        ValueError, match=rf"a run without air left a checkpoint there.*load_state\('{newest}'\)"
    ):
        accelerator.load_state()
    assert not same(model, saved), "nothing was loaded"
    accelerator.load_state(newest)
    assert same(model, saved) and counter.value == 6
    accelerator.end_training()
