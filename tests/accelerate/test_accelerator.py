"""AirAccelerator in one process with a real Accelerator: layout, stock compatibility, refusals, MLflow."""

from __future__ import annotations

import logging
import os
import signal

import fsspec
import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from accelerate_air import AirAccelerator, AirPlugin
from air_core import ConfigError, HealthCheckError, StorageError
from air_core.session import ResumeRng
from tests.accelerate.runs import run_job


class Counter:
    """A registered custom object, as ``register_for_checkpointing`` expects."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def setup(accelerator: Accelerator, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=4, shuffle=True)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return model, optimizer, loader, scheduler, counter


def train(accelerator, model, optimizer, loader, scheduler, counter, steps: int) -> None:
    for _, (x,) in zip(range(steps), loader, strict=False):
        accelerator.backward((model(x) - x).pow(2).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.value += 1


def air(root: str, **kwargs) -> AirAccelerator:
    return AirAccelerator(air_plugin=AirPlugin(root, **kwargs), cpu=True)


@pytest.mark.parametrize("safe", [{}, {"safe_serialization": True}, {"safe_serialization": False}])
def test_checkpoint_folder_has_accelerate_layout_plus_one_air_file_per_rank(tmp_path, safe):
    """The files stock ``save_state`` writes with the same ``safe_serialization`` (its default too)."""
    stock = Accelerator(cpu=True)
    setup(stock)
    stock.save_state(str(tmp_path / "stock"), **safe)
    accelerator = air(str(tmp_path / "air"))
    setup(accelerator)
    url = accelerator.save_state(**safe)
    accelerator.wait_for_checkpoints()
    assert url == f"{tmp_path}/air/step-000000000"
    ours = set(os.listdir(tmp_path / "air/step-000000000"))
    assert ours == set(os.listdir(tmp_path / "stock")) | {"air-rank-00000.pt"}, "Accelerate's file names"
    accelerator.end_training()


def test_checkpoint_downloaded_from_s3_loads_with_stock_load_state(tmp_path, s3_root):
    accelerator = air(
        s3_root.url, storage_options=s3_root.storage_options, staging_dir=str(tmp_path / "nvme")
    )
    model, optimizer, loader, scheduler, counter = setup(accelerator)
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=5)
    accelerator.save_state(f"{s3_root.url}/after-5")  # a folder of the root: one of its checkpoints
    accelerator.wait_for_checkpoints()
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    want_sched = scheduler.state_dict()["last_epoch"]
    want_rng = torch.get_rng_state()
    accelerator.end_training()

    local = tmp_path / "download"
    fs = fsspec.filesystem("s3", **s3_root.storage_options)
    fs.get(f"{s3_root.url}/after-5/", f"{local}/", recursive=True)
    stock = Accelerator(cpu=True)
    model2, optimizer2, _, scheduler2, counter2 = setup(stock, seed=1)
    torch.manual_seed(123)
    stock.load_state(str(local))
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in want_model.items()), "weights restored"
    assert torch.equal(optimizer2.state_dict()["state"][0]["exp_avg"], want_opt), "optimizer restored"
    assert scheduler2.state_dict()["last_epoch"] == want_sched == 5
    assert counter2.value == 5, "registered object restored"
    assert torch.equal(torch.get_rng_state(), want_rng), "RNG restored"


def test_load_state_by_folder_by_name_and_latest(tmp_path):
    accelerator = air(str(tmp_path / "ckpts"))
    model, optimizer, loader, scheduler, counter = setup(accelerator)
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=2)
    assert accelerator.save_state(str(tmp_path / "ckpts" / "first")) == str(tmp_path / "ckpts" / "first")
    first = {k: v.clone() for k, v in model.state_dict().items()}
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=2)
    accelerator.save_state()
    accelerator.load_state(str(tmp_path / "ckpts" / "first"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in first.items())
    assert (accelerator.completed_steps, counter.value) == (2, 2)
    accelerator.load_state()  # the newest committed one
    assert (accelerator.completed_steps, counter.value) == (4, 4)
    accelerator.load_state("first")  # a bare name that is no local folder: the root's checkpoint
    assert (accelerator.completed_steps, counter.value) == (2, 2)
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nope"):
        accelerator.load_state(str(tmp_path / "nope"))
    accelerator.end_training()


def test_partial_checkpoint_is_never_loaded_and_a_corrupt_one_is_skipped(tmp_path, caplog):
    root = tmp_path / "ckpts"
    accelerator = air(str(root), keep_last=3)  # retention must not race the test's own damage
    model, optimizer, loader, scheduler, counter = setup(accelerator)
    assert accelerator.resume() == 0, "nothing committed: a fresh start"
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=2)
    accelerator.save_state()
    older = {k: v.clone() for k, v in model.state_dict().items()}
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=2)
    accelerator.save_state()
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=2)
    accelerator.save_state()
    accelerator.wait_for_checkpoints()
    (root / ".air/step-000000006/manifest.json").unlink()  # step 6 becomes a partial checkpoint
    weights = root / "step-000000004/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one changed byte in step 4
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        accelerator.load_state()
    assert (
        "skipping checkpoint step-000000004" in caplog.text and "does not match its manifest" in caplog.text
    )
    assert all(torch.equal(model.state_dict()[k], v) for k, v in older.items()), "fell back to step 2"
    assert accelerator.completed_steps == 2
    accelerator.end_training()


def test_bad_configuration_fails_at_construction_naming_the_argument(tmp_path):
    with pytest.raises(ConfigError, match=r"^AirPlugin\(keep_last=0\)"):  # the class the user built
        AirPlugin(str(tmp_path), keep_last=0)
    with pytest.raises(ConfigError, match=r"^AirPlugin\(keep_last='2'\): keep_last must be an integer"):
        AirPlugin(str(tmp_path), keep_last="2")
    with pytest.raises(ConfigError, match=r"^AirPlugin\(max_in_flight=0\)"):
        AirPlugin(str(tmp_path), max_in_flight=0)
    with pytest.raises(ConfigError, match="root"):
        AirPlugin("")
    for seconds in (0, -1):  # by the name the user passed, not the checkpointer's close_timeout_seconds
        with pytest.raises(ConfigError, match=rf"^AirPlugin\(flush_timeout_seconds={seconds}\)"):
            AirPlugin(str(tmp_path), flush_timeout_seconds=seconds)
    assert AirPlugin(tmp_path / "ckpts", staging_dir=tmp_path / "nvme").root == str(tmp_path / "ckpts")
    with pytest.raises(ConfigError, match="air_plugin"):
        AirAccelerator(air_plugin=str(tmp_path), cpu=True)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(HealthCheckError, match="a-file") as unusable:  # the pre-flight's storage check
        air(str(blocker / "ckpts"))
    assert "BAD     storage" in str(unusable.value)
    with pytest.raises((StorageError, ConfigError), match="a-file"):  # without it, the checkpointer
        air(str(blocker / "ckpts"), preflight=False)
    with pytest.raises(ConfigError, match=r"^AirPlugin\(local_dir=.*a-file exists and is not a folder"):
        AirPlugin(str(tmp_path), local_every_n_steps=5, local_dir=str(blocker))
    with pytest.raises(ConfigError, match=r"^AirPlugin\(staging_dir=.*a-file exists and is not a folder"):
        AirPlugin(str(tmp_path), staging_dir=str(blocker))  # not only when AirAccelerator is built
    assert "storage_options" not in repr(AirPlugin("s3://b/p", storage_options={"secret": "s3cr3t"}))


@pytest.mark.slow
def test_resumed_job_continues_the_same_mlflow_run(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = ("--mlflow", uri, "--tracker", "--epochs", "1", "--every", "5")
    run_job(tmp_path, *args, "--kill", "10:upload_start", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args)
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("air-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "the resumed job logged into the run of the first launch, and left no other run"
    steps = {m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")}
    assert steps == set(range(16)), "one run holds every step's loss"


def test_a_0_1_rank_file_resumes_the_same_batches_through_the_migration():
    """0.1 kept RNG and loader positions at the top level of air-rank-<r>.pt; they still resume."""
    from torch.utils.data import DataLoader

    from accelerate_air.layout import rank_state_of
    from air_core.session import TrackedLoader, capture_rng

    def loader():
        return DataLoader(list(range(40)), batch_size=4, shuffle=True)

    torch.manual_seed(0)
    tracked = TrackedLoader(loader(), epoch=lambda: 0)
    it = iter(tracked)
    for _ in range(4):
        next(it)
    position, rng = tracked.position(), capture_rng()
    rest = [b.tolist() for b in it]
    old_position = {  # what 0.1's TrackedLoader.position() wrote
        "where": position["where"],
        "epoch": position["epoch"],
        "consumed": position["consumed"],
        "epoch_start": position["epoch_start"],
        "ahead": position["ahead"],
        "now": {"rng": rng, "generators": position["generators"]},
    }
    old = {
        "world_size": 1,
        "completed_steps": 3,
        "rng": rng,
        "loaders": [{"position": old_position, "state": None}, {"position": None, "state": None}],
        "mlflow_run_id": "abc",
    }
    state = rank_state_of(old)
    assert state["world_size"] == 1 and state["mlflow_run_id"] == "abc" and state["loaders"][1] is None
    torch.manual_seed(99)
    again = TrackedLoader(loader(), epoch=lambda: 0)
    again.resume(state["loaders"][0], ResumeRng(state["rng"]))
    assert [b.tolist() for b in again] == rest, "the 0.1 position resumes the same batches"


@pytest.mark.parametrize("overlap", [True, False])
def test_each_save_holds_its_steps_state_with_or_without_overlapped_copies(tmp_path, slow_copies, overlap):
    """With ``overlap_copies`` the prepared models' parameters and the optimizer's state are copied on a
    thread, overlapping the next forward and backward, and the prepared optimizer's step waits for them.
    With every such copy slowed past the next backward, each checkpoint holds exactly its own step's
    weights and optimizer state. Without the setting nothing is copied after ``save_state`` returns."""
    accelerator = air(str(tmp_path / "air"), keep_last=3, overlap_copies=overlap)
    model, optimizer, loader, scheduler, counter = setup(accelerator)
    saved = {}
    for _ in range(3):
        train(accelerator, model, optimizer, loader, scheduler, counter, steps=2)
        url = accelerator.save_state()  # nothing but the next optimizer step may change them: capture now
        state = optimizer.state_dict()["state"]
        saved[url] = (
            {k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in state.items()},
        )
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=1)
    accelerator.wait_for_checkpoints()
    accelerator.end_training()
    assert len(saved) == 3
    assert len(slow_copies) == (3 if overlap else 0), "with overlap_copies, every save's copies on the thread"
    for url, (weights, state) in saved.items():
        got = load_file(f"{url}/model.safetensors")
        got_state = torch.load(f"{url}/optimizer.bin", weights_only=True)["state"]
        for key, value in weights.items():
            assert torch.equal(got[key], value), f"{url}: {key} is another step's"
        for i, s in state.items():
            for key, value in s.items():
                assert torch.equal(got_state[i][key], value), f"{url}: optimizer {i} {key}"


def test_every_prepared_optimizer_waits_for_the_overlapped_copies(tmp_path, slow_copies):
    """Two models, two prepared optimizers (a GAN's pair): whichever steps first after ``save_state`` waits
    for the copies, so the second model's checkpoint holds its weights at the save."""
    accelerator = air(str(tmp_path / "air"), overlap_copies=True)
    torch.manual_seed(0)
    nets = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    opts = [torch.optim.AdamW(n.parameters(), lr=1e-2) for n in nets]
    *nets, opt_a, opt_b = accelerator.prepare(*nets, *opts)
    x = torch.randn(4, 8)

    def step(order) -> None:
        accelerator.backward(sum(n(x).pow(2).mean() for n in nets))
        for opt in order:
            opt.step()
            opt.zero_grad()

    step([opt_a, opt_b])
    url = accelerator.save_state()
    want = [{k: v.clone() for k, v in n.state_dict().items()} for n in nets]
    step([opt_b, opt_a])  # the second optimizer steps first
    accelerator.wait_for_checkpoints()
    accelerator.end_training()
    assert len(slow_copies) == 1
    for i, name in enumerate(["model.safetensors", "model_1.safetensors"]):
        got = load_file(f"{url}/{name}")
        assert all(torch.equal(got[k], v) for k, v in want[i].items()), f"{name} holds another step's weights"


def test_a_run_saving_to_the_local_tier_only_keeps_its_goodput_log_at_the_root(tmp_path):
    """Its saves are the tier's, no root's records; the next launch resumes from them and counts this one."""
    root = tmp_path / "ckpts"
    accelerator = air(str(root), local_every_n_steps=2, local_dir=str(tmp_path / "local"))
    model, optimizer, loader, scheduler, counter = setup(accelerator)
    train(accelerator, model, optimizer, loader, scheduler, counter, steps=4)
    accelerator.end_training()
    assert len(list((root / ".air-events").iterdir())) == 1
