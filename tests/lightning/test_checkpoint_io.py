"""AirCheckpointIO on its own and inside a real Trainer: formats, refusals, ordering, errors."""

from __future__ import annotations

import os
from typing import Any

import fsspec
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import tests.faultfs  # noqa: F401  (registers flaky://)
from air_core import AsyncCheckpointer, ConfigError, CorruptCheckpointError, SaveError
from air_core.session import SessionConfig, TrainingSession
from lightning_air import AirCallback, AirCheckpointIO, latest_checkpoint
from tests.conftest import REPO, run_python
from tests.lightning.model import Model
from tests.lightning.test_crash_resume import run_job
from tests.sameness import assert_same_run
from tests.zygote import python


def _trainer(tmp_path, plugin=None, callbacks=(), **kw) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        plugins=[plugin or AirCheckpointIO()],
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        **kw,
    )


def _fit(tmp_path, every=4, save_last=False, top_k=-1) -> str:
    dirpath = str(tmp_path / "ckpts")
    mc = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=every, save_top_k=top_k, save_last=save_last)
    trainer = _trainer(tmp_path, callbacks=[AirCallback(), mc])
    trainer.fit(Model(str(tmp_path), 0))
    return dirpath


def test_checkpoint_loads_with_plain_torch_and_lightning_without_the_plugin(tmp_path):
    dirpath = _fit(tmp_path)
    path = latest_checkpoint(dirpath)
    assert path is not None and path.endswith("step=16.ckpt")
    code = (
        "import sys, torch\n"
        "from tests.lightning.model import Model\n"
        f"ckpt = torch.load({path!r}, weights_only=False)\n"
        f"model = Model.load_from_checkpoint({path!r})\n"
        "assert all(torch.equal(model.state_dict()[k], v) for k, v in ckpt['state_dict'].items())\n"
        "plugin = [m for m in sys.modules if m.startswith(('lightning_air', 'air_core'))]\n"
        "assert not plugin, plugin\n"
        "print('global_step', ckpt['global_step'])\n"
    )
    out = run_python(code, env={"PYTHONPATH": REPO}, interpreter=python())  # imports no air-plugins module
    assert out.returncode == 0, out.stderr
    assert "global_step 16" in out.stdout


def test_load_refuses_a_checkpoint_that_is_not_committed(tmp_path):
    dirpath = _fit(tmp_path)
    newest = latest_checkpoint(dirpath)
    for manifest in (tmp_path / "ckpts/.air").glob("*/manifest.json"):
        manifest.unlink()  # as if every save had died before its commit
    plugin = AirCheckpointIO()
    with pytest.raises(CorruptCheckpointError, match="no committed checkpoint holds it: the save that was"):
        plugin.load_checkpoint(newest)
    assert latest_checkpoint(dirpath) is None, "a relaunch starts fresh rather than from an uncommitted file"


def test_load_of_a_committed_file_changed_since_says_it_was_committed_and_changed(tmp_path):
    """It said that the save writing it 'did not finish', and named Accelerate's API in a Lightning job."""
    dirpath = _fit(tmp_path)
    newest = latest_checkpoint(dirpath)
    os.truncate(newest, os.path.getsize(newest) - 10)
    with pytest.raises(CorruptCheckpointError, match="it was committed, but its files were changed") as error:
        AirCheckpointIO().load_checkpoint(newest)
    assert "AirAccelerator" not in str(error.value) and "air ls" in str(error.value)


def test_corrupt_newest_checkpoint_is_skipped_by_latest_checkpoint(tmp_path):
    dirpath = _fit(tmp_path)
    newest = latest_checkpoint(dirpath)
    data = bytearray(open(newest, "rb").read())
    data[-100] ^= 0xFF
    open(newest, "wb").write(bytes(data))
    assert latest_checkpoint(dirpath).endswith("step=12.ckpt")
    with pytest.raises(CorruptCheckpointError, match="does not match its manifest"):
        AirCheckpointIO().load_checkpoint(newest)


def _ckpt_files(root: str) -> list[str]:
    return sorted(f for f in os.listdir(root) if not f.startswith(".air"))


def _asynchronous_plugin(**kw: Any) -> AirCheckpointIO:
    """The plugin as ``AirCallback.setup`` leaves it: saves return after the snapshot until the session
    closes."""
    plugin = AirCheckpointIO(**kw)
    plugin.use(TrainingSession(SessionConfig(mlflow=False, owner="test"), checkpointer=plugin.config))
    return plugin


def _end_fit(plugin: AirCheckpointIO) -> None:
    """As a fit's end does: the strategy's teardown, then ``AirCallback`` closes its session."""
    try:
        plugin.teardown()
    finally:  # a failed save raises from the teardown; the callback's ``on_exception`` then closes
        plugin.session.close(0)


def test_a_removal_whose_replacement_failed_keeps_the_newest_committed_checkpoint(tmp_path):
    """Top-k saves the new file, then removes the old one: while saves are asynchronous the removal waits
    for the new save, and when that failed (access denied at the root) the old commit stays, the one the
    job can resume from. Once a newer save commits, the removal goes ahead."""
    root = f"flaky://{tmp_path.name}/ckpts"
    fs = fsspec.filesystem("flaky")

    def files() -> list[str]:
        return sorted(p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False) if p.endswith(".ckpt"))

    def plugin(**storage_options: Any) -> AirCheckpointIO:
        return _asynchronous_plugin(staging_dir=str(tmp_path / "nvme"), storage_options=storage_options)

    first = plugin()
    first.save_checkpoint({"global_step": 1, "w": torch.ones(2)}, f"{root}/s1.ckpt")
    _end_fit(first)
    denied = plugin(permanent_error="denied")
    denied.save_checkpoint({"global_step": 2, "w": torch.ones(2) * 2}, f"{root}/s2.ckpt")
    denied.remove_checkpoint(f"{root}/s1.ckpt")
    with pytest.raises(SaveError, match="s2.*Access Denied"):
        _end_fit(denied)
    assert files() == ["s1.ckpt"], "the only commit stays while its replacement failed"
    third = plugin()
    third.save_checkpoint({"global_step": 3, "w": torch.ones(2) * 3}, f"{root}/s3.ckpt")
    third.remove_checkpoint(f"{root}/s1.ckpt")
    _end_fit(third)
    assert files() == ["s3.ckpt"]
    third.remove_checkpoint(f"{root}/s3.ckpt")  # outside a fit an explicit removal is done as asked
    assert files() == []


def test_save_top_k_frees_the_staging_disk_too(tmp_path):
    """The staged files are links to the root's (one disk): a copy the cache kept of a checkpoint
    ``save_top_k`` removed held its blocks, so the removal freed nothing."""
    stage, dirpath = tmp_path / "nvme", str(tmp_path / "ckpts")
    mc = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=1)
    plugin = AirCheckpointIO(staging_dir=str(stage))
    _trainer(tmp_path, plugin, callbacks=[AirCallback(mlflow=False), mc]).fit(Model(str(tmp_path), 0))
    (kept,) = _ckpt_files(dirpath)
    staged = [f for _, _, files in os.walk(stage) for f in files if f.endswith(".ckpt")]
    assert staged == [kept], "only the checkpoint the root keeps"


def test_removing_the_fits_last_save_deletes_it_as_lightning_does(tmp_path):
    """``BatchSizeFinder`` and ``LearningRateFinder`` save a temporary file, load it back and remove it,
    all during the fit: no later save replaces it, so it goes as stock Lightning removes it (once its save
    committed), rather than waiting for a newer commit that never comes to that folder."""
    plugin = _asynchronous_plugin()
    root = str(tmp_path / "run")
    plugin.save_checkpoint({"global_step": 0, "w": torch.randn(1 << 22)}, f"{root}/.scale_batch_size_x.ckpt")
    plugin.remove_checkpoint(f"{root}/.scale_batch_size_x.ckpt")  # in flight: removed once it commits
    _end_fit(plugin)
    assert _ckpt_files(root) == []
    with AsyncCheckpointer(root, read_only=True) as reader:
        assert reader.list() == [], "the temporary commit is gone, not kept as the newest"


def test_removing_a_save_still_in_flight_deletes_it_once_a_newer_one_commits(tmp_path):
    plugin = _asynchronous_plugin()
    root = str(tmp_path / "ckpts")
    big = {"global_step": 1, "w": torch.randn(1 << 22)}  # 16 MiB: still being written when removed
    plugin.save_checkpoint(big, f"{root}/s1.ckpt")
    plugin.remove_checkpoint(f"{root}/s1.ckpt")  # top-k dropping the checkpoint it just saved
    plugin.save_checkpoint({"global_step": 2, "w": torch.ones(2)}, f"{root}/s2.ckpt")
    _end_fit(plugin)
    assert _ckpt_files(root) == ["s2.ckpt"], "the removed checkpoint must not leak"


@pytest.mark.parametrize("top_k", [-1, 0])
def test_save_last_rewrites_last_ckpt_and_it_stays_committed(tmp_path, top_k):
    dirpath = _fit(tmp_path, save_last=True, top_k=top_k)
    assert os.path.exists(os.path.join(dirpath, "last.ckpt")), (
        "retiring the old last commit keeps the new file"
    )
    state = AirCheckpointIO().load_checkpoint(os.path.join(dirpath, "last.ckpt"))
    assert state["global_step"] == 16, "last.ckpt is the newest save, committed"
    newest = latest_checkpoint(dirpath)
    assert newest is not None and torch.load(newest, weights_only=False)["global_step"] == 16


def test_bad_settings_fail_at_construction_naming_the_argument(tmp_path):
    with pytest.raises(ConfigError, match=r"^AirCheckpointIO\(on_busy='drop'\)"):  # the class the user built
        AirCheckpointIO(on_busy="drop")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^AirCheckpointIO\(host_budget_bytes=0\)"):
        AirCheckpointIO(host_budget_bytes=0)
    with pytest.raises(ConfigError, match="log_every_n_steps"):
        AirCallback(log_every_n_steps="7")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="flush_timeout_seconds"):
        AirCallback(flush_timeout_seconds=0)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"^AirCallback\(local_dir=.*a-file exists and is not a folder"):
        AirCallback(local_every_n_steps=5, local_dir=str(blocker))
    with pytest.raises(ConfigError, match=r"^AirCheckpointIO\(staging_dir=.*a-file exists and is not a"):
        AirCheckpointIO(staging_dir=str(blocker))
    with pytest.raises(TypeError, match="storage_options"):
        AirCheckpointIO().save_checkpoint({}, "/tmp/x.ckpt", storage_options={"a": 1})


def test_callback_without_the_plugin_fails_before_any_step(tmp_path):
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        callbacks=[AirCallback()],
        logger=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(ConfigError, match="AirCallback needs AirCheckpointIO"):
        trainer.fit(Model(str(tmp_path), 0))
    assert not (tmp_path / "ids-rank0.jsonl").exists(), "no training step may run"


def test_two_air_callbacks_are_refused_before_any_step_naming_the_fix(tmp_path):
    trainer = _trainer(tmp_path, callbacks=[AirCallback(mlflow=False), AirCallback(mlflow=False)])
    with pytest.raises(ConfigError, match=r"holds 2 AirCallbacks.*Keep one AirCallback"):
        trainer.fit(Model(str(tmp_path), 0))
    assert not (tmp_path / "ids-rank0.jsonl").exists(), "no training step may run"


def test_overlapped_copies_are_refused_beside_a_callback_that_swaps_weights_in(tmp_path):
    from lightning.pytorch.callbacks import WeightAveraging

    trainer = _trainer(tmp_path, callbacks=[AirCallback(overlap_copies=True), WeightAveraging()])
    with pytest.raises(ConfigError, match=r"overlap_copies=True\) cannot run with WeightAveraging.*Drop"):
        trainer.fit(Model(str(tmp_path), 0))
    assert not (tmp_path / "ids-rank0.jsonl").exists(), "no training step may run"


@pytest.mark.slow
def test_dirpath_on_s3_crash_and_resume_exactly(tmp_path_factory, s3_root, monkeypatch):
    reference = tmp_path_factory.mktemp("s3-reference")
    run_job(reference, "--epochs", "2")
    resumed = tmp_path_factory.mktemp("s3-resumed")
    s3 = ["--epochs", "2", "--root", s3_root.url, "--endpoint", s3_root.endpoint]
    run_job(resumed, *s3, "--kill", "20:upload_start", expect_kill=True)
    run_job(resumed, *s3)
    assert_same_run(resumed, reference)


@pytest.mark.parametrize("overlap", [True, False])
def test_each_checkpoint_holds_its_steps_weights_with_or_without_overlapped_copies(
    tmp_path, slow_copies, overlap
):
    """With ``overlap_copies`` the trained parameters and AdamW state are copied on a thread, overlapping
    the next forward and backward, and ``AirCallback`` holds the optimizer step until they land. With every
    such copy slowed past the next step's backward, each checkpoint still holds exactly its own step's
    weights and optimizer state (without the gate the optimizer would have changed them first), though two
    ``ModelCheckpoint``s save at each of those steps (two buffers, so the second save need not wait for the
    first). Without the setting nothing is copied after the save returns."""
    saved: dict[int, tuple[dict, dict]] = {}

    class Capture(pl.Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            opt = checkpoint["optimizer_states"][0]["state"]
            saved[trainer.global_step] = (
                {k: v.clone() for k, v in checkpoint["state_dict"].items()},
                {i: {k: v.clone() for k, v in s.items()} for i, s in opt.items()},
            )

    dirpath = str(tmp_path / "ckpts")
    mc = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=3, save_top_k=-1)
    other = ModelCheckpoint(
        dirpath, "b-{step}", monitor="step", mode="max", every_n_train_steps=3, save_top_k=-1
    )
    callback = AirCallback(overlap_copies=overlap)
    plugin = AirCheckpointIO(max_in_flight=2)
    trainer = _trainer(tmp_path, plugin, callbacks=[callback, mc, other, Capture()], max_steps=10)
    trainer.fit(Model(str(tmp_path), 0))
    assert sorted(saved) == [3, 6, 9]
    assert len(slow_copies) == (6 if overlap else 0), "with overlap_copies, every save's copies on the thread"
    for step, (weights, optimizer) in saved.items():
        for name in (f"epoch=0-step={step}.ckpt", f"b-step={step}.ckpt"):
            ckpt = torch.load(f"{dirpath}/{name}", weights_only=True)
            for key, value in weights.items():
                assert torch.equal(ckpt["state_dict"][key], value), f"{name}: {key} is another step's"
            for i, state in optimizer.items():
                for key, value in state.items():
                    assert torch.equal(ckpt["optimizer_states"][0]["state"][i][key], value), f"{name}: {key}"


def test_top_k_bounds_the_files_after_the_folders_checkpoints_were_removed_by_hand(tmp_path):
    """``rm ckpts/*.ckpt`` between two runs leaves ``.air/``: the first run's commit, damaged, named the
    file the second run saved at the same step, looked committed again, and kept that file from top-k's
    delete. Now a save or removal of the entry retires the damaged commit too, as stock ends."""
    dirpath = tmp_path / "ckpts"

    def run(steps: int) -> list[str]:
        mc = ModelCheckpoint(dirpath=str(dirpath), every_n_train_steps=2)  # save_top_k=1
        _trainer(tmp_path, callbacks=[AirCallback(mlflow=False), mc], max_steps=steps).fit(
            Model(str(tmp_path), 0)
        )
        return sorted(p.name for p in dirpath.glob("*.ckpt"))

    assert run(8) == ["epoch=0-step=8.ckpt"]
    for path in dirpath.glob("*.ckpt"):
        path.unlink()
    assert run(16) == ["epoch=0-step=16.ckpt"]
    with AsyncCheckpointer(str(dirpath), read_only=True) as reader:
        assert [(i.step, i.status) for i in reader.list()] == [(16, "committed")]
