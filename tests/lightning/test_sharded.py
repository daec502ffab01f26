"""FSDP2 under ``AirModelParallelStrategy`` on 2 CPU processes (gloo): sharded saves go through the core
(asynchronous, staged, committed, to S3), a SIGKILL mid-save resumes exactly, and the committed folder
is Lightning's stock sharded layout."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import fsspec
import lightning.pytorch as pl
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from air_core import AsyncCheckpointer, ConfigError
from lightning_air import AirCallback, AirCheckpointIO, AirFSDPStrategy, latest_checkpoint
from tests.concurrent_jobs import finish, start
from tests.conftest import REPO
from tests.lightning.model import N_SAMPLES
from tests.lightning.test_crash_resume import run_job
from tests.sameness import assert_same_run, assert_tier_read_in_place, records
from tests.torchrun_nodes import lose_node_b, restored_on_c
from tests.zygote import python

JOB = os.path.join(REPO, "tests/lightning/sharded_job.py")

TWO_RANKS = [".metadata", "__0_0.distcp", "__1_0.distcp", "__1_1.distcp", "meta.pt"]
"""A two-rank sharded folder: each rank's shards, the whole tensors and objects DCP gave rank 1, meta.pt."""


def run_sharded(workdir: Path, *args: str, expect_kill: bool = False, lost_peer: bool = False) -> None:
    run_job(workdir, *args, expect_kill=expect_kill, lost_peer=lost_peer, job=JOB)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 2-process run (local dirpath), checkpointing every 5 steps."""
    workdir = tmp_path_factory.mktemp("sharded-reference")
    run_sharded(workdir)
    return workdir


@pytest.fixture(scope="module")
def reference_fsdp1(tmp_path_factory) -> Path:
    """The same run with FSDP1 under ``AirFSDPStrategy`` (on CPU only in the test job: sharded_job.py)."""
    workdir = tmp_path_factory.mktemp("fsdp1-reference")
    run_sharded(workdir, "--fsdp1")
    return workdir


@pytest.mark.slow
def test_sharded_fit_killed_between_root_saves_resumes_from_the_local_tier_exactly(reference, tmp_path):
    """``ModelCheckpoint`` every 5 steps, ``AirCallback(local_every_n_steps=2)``, ``ckpt_path=NEWEST``: both
    ranks killed at once before step 8 resume from step 6 (each rank's own shards, the ``.metadata``
    merged from their shares, rank 0's ``meta.pt``), bitwise equal to the uninterrupted run."""
    run_sharded(tmp_path, "--local-every", "2", "--die", "8", expect_kill=True)
    run_sharded(tmp_path, "--local-every", "2")
    assert_same_run(tmp_path, reference, ranks=2)
    restores = json.loads((tmp_path / "restores-rank0.json").read_text())
    assert restores[0][0] == "local-s000000006-w2", restores
    assert_tier_read_in_place(tmp_path)


@pytest.mark.slow
def test_a_replaced_node_gets_its_shards_from_the_partner_and_the_fit_resumes_exactly(reference, tmp_path):
    """Nodes A and B (torchrun agents, a job of fixed size, one process each; ``Trainer(num_nodes=2)``),
    local saves every 2 steps: B is lost before step 8 and node C joins with an empty local folder. Step 6
    is A's own part and A's copy of B's; C is sent both without their shards, and its load brings the
    shard files its plan reads from A (its own, never rank 0's). The fit is the uninterrupted one."""
    args = ("--local-every", "2", "--devices", "1", "--die", "8:B")
    logs = lose_node_b(JOB, tmp_path, *args, min_nodes=2, replace_when=lambda agent: agent.poll() is not None)
    log = logs["A"] + logs["C"]
    assert "resuming from local tier step 6 (replica)" in log, log[-4000:]
    assert "from node A, rank 1: from node A" in log, "the new node's parts came from A"
    assert_same_run(tmp_path, reference, ranks=2)
    rank, restored = restored_on_c(tmp_path)
    on_c = sorted(p.name for p in restored.glob("*/__*.distcp"))
    assert f"__{rank}_0.distcp" in on_c and f"__{1 - rank}_0.distcp" not in on_c, f"C's own: {on_c}"


@pytest.mark.slow
def test_sharded_saves_to_s3_killed_mid_upload_resume_exactly(reference, tmp_path, s3_root):
    s3 = ["--root", s3_root.url, "--endpoint", s3_root.endpoint]
    run_sharded(tmp_path, *s3, "--kill", "10:upload_start", expect_kill=True)
    newest = latest_checkpoint(s3_root.url, storage_options=s3_root.storage_options)
    assert newest is not None and newest.endswith("epoch=0-step=5.ckpt"), newest
    run_sharded(tmp_path, *s3)
    assert_same_run(tmp_path, reference, ranks=2)  # samples, augmentation and final weights
    with AsyncCheckpointer(s3_root.url, storage_options=s3_root.storage_options, read_only=True) as ckpt:
        committed = [i for i in ckpt.list() if i.status == "committed"]
    assert [i.step for i in committed] == [5, 10, 15]
    # A downloaded copy of the newest folder is a stock DCP checkpoint.
    local = tmp_path / "download"
    fs = fsspec.filesystem("s3", **s3_root.storage_options)
    fs.get(f"{s3_root.url}/epoch=1-step=15.ckpt/", str(local), recursive=True)
    saved = torch.load(tmp_path / "saved-15.pt")
    state = {"state_dict": {k: torch.zeros_like(v) for k, v in saved.items()}}
    dcp.load(state, storage_reader=FileSystemReader(str(local)), no_dist=True)
    assert all(torch.equal(state["state_dict"][k], v) for k, v in saved.items())


@pytest.mark.slow
def test_fsdp1_sharded_saves_killed_mid_upload_resume_exactly_in_lightnings_fsdp_layout(
    reference_fsdp1, tmp_path
):
    """``AirFSDPStrategy(state_dict_type="sharded")``: FSDP1's ``ShardedTensor`` state goes through the
    core as FSDP2's DTensors do: rank 1 killed while uploading step 10 leaves step 5 the newest, and the
    resume is the uninterrupted run. The folder is stock ``FSDPStrategy``'s (``model``/``optimizer_0``
    + ``meta.pt``) and loads with stock DCP into plain tensors."""
    run_sharded(tmp_path, "--fsdp1", "--kill", "10:upload_start:1", lost_peer=True)
    newest = latest_checkpoint(str(tmp_path / "ckpts"))
    assert newest is not None and newest.endswith("epoch=0-step=5.ckpt"), newest
    run_sharded(tmp_path, "--fsdp1")
    assert_same_run(tmp_path, reference_fsdp1, ranks=2)
    for rank in range(2):  # its shards, the DCP metadata, meta.pt, the other ranks' state: one restore
        ((name, source),) = json.loads((tmp_path / f"restores-rank{rank}.json").read_text())
        assert name.startswith("ckpt-000000005-") and source == "cache", (name, source)
    folder = tmp_path / "ckpts" / "epoch=1-step=15.ckpt"
    assert sorted(os.listdir(folder)) == TWO_RANKS
    assert {k.split(".")[0] for k in FileSystemReader(str(folder)).read_metadata().state_dict_metadata} == {
        "model",
        "optimizer_0",
    }
    saved = torch.load(tmp_path / "saved-15.pt")
    state = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
    dcp.load(state, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    assert all(torch.equal(state["model"][k], v) for k, v in saved.items())


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3"])
def test_full_saves_of_the_sharded_strategy_carry_every_ranks_part_and_resume_exactly(
    reference, tmp_path, where, request
):
    """``save_distributed_checkpoint=False``: rank 0 writes one full file, and every other rank's data
    position must still reach the commit (it did not: ranks > 0 skipped their part). Lightning reads
    that file itself on every rank: from a verified local copy (the cache, for S3)."""
    args: list[str] = []
    root, opts = str(tmp_path / "ckpts"), None
    if where == "s3":
        s3_root = request.getfixturevalue("s3_root")
        args = ["--root", s3_root.url, "--endpoint", s3_root.endpoint]
        root, opts = s3_root.url, s3_root.storage_options
    run_sharded(tmp_path, "--full", *args, "--kill", "10:upload_start:0", expect_kill=True)
    with AsyncCheckpointer(root, storage_options=opts, read_only=True) as ckpt:
        (newest,) = [i for i in ckpt.list() if i.status == "committed"]
        assert newest.step == 5 and newest.manifest is not None
        files = sorted(f.path for f in newest.manifest.files)
    part, full = files
    assert full == "epoch=0-step=5.ckpt", "one full file, as Lightning writes it"
    assert part.endswith("part-rank-00001.pt"), files
    run_sharded(tmp_path, "--full", *args)
    assert_same_run(tmp_path, reference, ranks=2)


@pytest.mark.slow
def test_last_ckpt_switching_between_sharded_and_full_saves_replaces_the_old_one(tmp_path):
    """``save_last`` with sharded saves, then full ones into the same dirpath (resumed), then sharded
    again: each ``last.ckpt`` replaces the other kind, as Lightning's own removes it before saving. A
    full file where a sharded folder was cached failed the save, and a sharded save's other ranks wrote
    into the path of a full file that rank 0 had not yet removed."""
    root = tmp_path / "ckpts"
    for epochs, kind in ((1, []), (2, ["--full"]), (3, [])):
        saved = sorted(int(p.stem.split("-")[1]) for p in tmp_path.glob("saved-*.pt"))  # by FullWeights
        run_sharded(tmp_path, "--epochs", str(epochs), "--save-last", *kind)
        last = root / "last.ckpt"
        assert last.is_file() if kind else last.is_dir(), f"after {epochs} epoch(s)"
        if saved:  # resumed from the other kind of last.ckpt: the weights of the newest save
            loaded, expected = (
                torch.load(tmp_path / "loaded.pt"),
                torch.load(tmp_path / f"saved-{saved[-1]}.pt"),
            )
            assert all(torch.equal(loaded[k], v) for k, v in expected.items()), f"step {saved[-1]}"
    assert sorted(os.listdir(root / "last.ckpt")) == TWO_RANKS
    assert latest_checkpoint(str(root)) == str(root / "last.ckpt")


@pytest.mark.slow
def test_a_committed_sharded_checkpoint_is_lightnings_stock_layout(reference):
    """Stock Lightning loads a sharded folder with ``dcp.load(checkpoint_id=folder)`` + ``meta.pt``."""
    folder = Path(latest_checkpoint(str(reference / "ckpts")))
    assert folder.name == "epoch=1-step=15.ckpt" and folder.is_dir()
    assert sorted(os.listdir(folder)) == TWO_RANKS
    saved = torch.load(reference / "saved-15.pt")
    state = {"state_dict": {k: torch.zeros_like(v) for k, v in saved.items()}}
    dcp.load(state, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    assert all(torch.equal(state["state_dict"][k], v) for k, v in saved.items())
    meta = torch.load(folder / "meta.pt", weights_only=False)
    assert meta["global_step"] == 15 and "state_dict" not in meta


@pytest.mark.slow
@pytest.mark.parametrize("callback", ["with AirCallback", "plugin only"])
def test_a_sharded_save_after_fit_is_committed_when_it_returns(tmp_path, callback):
    """The notebook pattern, every rank calling ``trainer.save_checkpoint`` after ``fit``; and a fit without
    ``AirCallback``. Both failed: the plugin's own session was one rank's (each rank named the commit
    alike, as rank 0 of 1), and after a fit with ``AirCallback`` the save stayed asynchronous, since
    ``ModelParallelStrategy``'s teardown does not tear the plugin down: the process ended first."""
    after = tmp_path / "notebook" / "after.ckpt"
    run_sharded(
        tmp_path,
        "--epochs",
        "1",
        "--save-after-fit",
        str(after),
        *(["--no-callback"] * (callback == "plugin only")),
    )
    assert latest_checkpoint(str(tmp_path / "ckpts")).endswith("epoch=0-step=5.ckpt")
    assert latest_checkpoint(str(after.parent)) == str(after)
    assert sorted(os.listdir(after)) == TWO_RANKS
    final = torch.load(tmp_path / "final.pt")
    state = {"state_dict": {k: torch.zeros_like(v) for k, v in final.items()}}
    dcp.load(state, storage_reader=FileSystemReader(str(after)), no_dist=True)
    assert all(torch.equal(state["state_dict"][k], v) for k, v in final.items())


@pytest.mark.slow
def test_stock_lightning_resumes_from_a_committed_sharded_checkpoint(reference, tmp_path):
    """``ModelParallelStrategy`` itself (no air-plugins class) resumes a fit from our folder."""
    folder = latest_checkpoint(str(reference / "ckpts"))
    run_sharded(tmp_path, "--stock-resume", folder)
    loaded, saved = torch.load(tmp_path / "loaded.pt"), torch.load(reference / "saved-15.pt")
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())
    resumed = [rec["step"] for r in range(2) for rec in records(tmp_path, r)]
    assert sorted(resumed) == [15, 15], "the stock fit continued at the saved step"


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", ["fsdp2", "fsdp1"])
def test_a_two_rank_sharded_checkpoint_continues_on_one_and_three_ranks(tmp_path_factory, fsdp):
    """Weights resharded by DCP equal the saved ones; the rest of the interrupted epoch is split over the
    new ranks, each sample once; training completes. FSDP2 (DTensor) and FSDP1 (ShardedTensor) state."""
    strategy = ["--fsdp1"] if fsdp == "fsdp1" else []
    saved = tmp_path_factory.mktemp(f"{fsdp}-two-ranks")
    run_sharded(
        saved, "--epochs", "1", *strategy
    )  # 8 steps an epoch on two ranks: the newest commit is step 5
    weights = torch.load(saved / "saved-5.pt")
    before = [i for r in range(2) for rec in records(saved, r) if rec["step"] < 5 for i in rec["ids"]]
    runs = {}
    for devices in (1, 3):
        work = tmp_path_factory.mktemp(f"{fsdp}-on-{devices}")
        shutil.copytree(saved / "ckpts", work / "ckpts")
        args = ("--devices", str(devices), "--epochs", "2", "--elastic", *strategy)
        runs[devices] = (work, start([python(), JOB, str(work), *args], work))
    finish({f"the sharded resume on {n} process(es)": run for n, run in runs.items()})
    for devices, (work, _) in runs.items():
        loaded = torch.load(work / "loaded.pt")
        assert all(torch.equal(loaded[k], weights[k]) for k in weights), f"on {devices}: the saved weights"
        seen = [records(work, rank) for rank in range(devices)]
        assert min(rec["step"] for rank in seen for rec in rank) == 5, "resumed at the saved step"
        rest = [i for rank in seen for rec in rank if rec["epoch"] == 0 for i in rec["ids"]]
        assert Counter(before + rest) == Counter(range(N_SAMPLES)), (
            f"on {devices} rank(s): every sample of the interrupted epoch exactly once"
        )
        assert (work / "final.pt").exists(), "training completed"


@pytest.mark.slow
def test_top_k_and_save_last_keep_only_their_sharded_folders(tmp_path):
    """ModelCheckpoint deletes and rewrites sharded folders through the plugin as it does files."""
    run_sharded(tmp_path, "--devices", "1", "--top-k", "1", "--save-last")
    root = tmp_path / "ckpts"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "epoch=1-step=30.ckpt",
        "last.ckpt",
    ]
    with AsyncCheckpointer(str(root), read_only=True) as ckpt:
        infos = ckpt.list()
    assert [(i.status, i.step) for i in infos] == [("committed", 30), ("committed", 30)]
    assert sorted(os.listdir(root / "last.ckpt")) == [".metadata", "__0_0.distcp", "meta.pt"]
    assert torch.load(root / "last.ckpt" / "meta.pt", weights_only=False)["global_step"] == 30
    assert latest_checkpoint(str(root)).rsplit("/", 1)[1] in {"epoch=1-step=30.ckpt", "last.ckpt"}


def test_stock_sharded_strategies_are_refused_before_training(tmp_path):
    from lightning.pytorch.strategies import ModelParallelStrategy

    from tests.lightning.model import Model

    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
        plugins=[AirCheckpointIO()],
        callbacks=[AirCallback()],
        logger=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(ConfigError, match="AirModelParallelStrategy"):
        trainer.fit(Model(str(tmp_path), 0))
    assert not (tmp_path / "ids-rank0.jsonl").exists(), "no training step may run"


def test_the_stock_fsdp_strategy_with_sharded_saves_is_refused_naming_ours(tmp_path):
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_air.callback import _check_sharded_saves_reach_the_plugin

    # FSDPStrategy needs a GPU to build a Trainer with; the check itself looks at the strategy only.
    with pytest.raises(ConfigError, match=r"lightning_air\.AirFSDPStrategy"):
        _check_sharded_saves_reach_the_plugin(FSDPStrategy(state_dict_type="sharded"))
    _check_sharded_saves_reach_the_plugin(FSDPStrategy(state_dict_type="full"))  # through the plugin
    _check_sharded_saves_reach_the_plugin(AirFSDPStrategy(state_dict_type="sharded"))


def test_air_fsdp_strategy_on_cpu_fails_when_the_trainer_is_built_naming_the_fsdp2_strategy(tmp_path):
    """Lightning refuses ``FSDPStrategy`` on CPU by its exact class; ours must refuse too, not fail deep
    inside torch when the model is wrapped."""
    with pytest.raises(ConfigError, match=r"needs GPUs.*AirModelParallelStrategy"):
        pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=AirFSDPStrategy(state_dict_type="sharded"),
            plugins=[AirCheckpointIO()],
            default_root_dir=str(tmp_path),
        )
