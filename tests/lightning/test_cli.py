"""The YAML example through LightningCLI: it trains and resumes; a mistyped key fails before training."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import REPO
from tests.zygote import python

TRAIN = os.path.join(REPO, "examples/lightning/train.py")
CONFIG = os.path.join(REPO, "examples/lightning/config.yaml")


def _cli(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python(), TRAIN, "fit", "--config", CONFIG, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": REPO},
    )


def test_yaml_example_trains_commits_and_a_relaunch_resumes(tmp_path):
    first = _cli(tmp_path, "--trainer.max_epochs", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    manifests = list((tmp_path / "remote/ckpts/.air").glob("*/manifest.json"))
    assert len(manifests) == 4, "32 steps with every_n_train_steps=8: four committed checkpoints"
    second = _cli(tmp_path, "--trainer.max_epochs", "2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Restored all states from the checkpoint" in second.stderr + second.stdout
    assert "epoch=0-step=32.ckpt" in second.stderr + second.stdout, "resumes from the newest commit"


def test_sharded_yaml_overlay_saves_sharded_folders_from_two_processes(tmp_path):
    sharded = os.path.join(REPO, "examples/lightning/sharded.yaml")
    run = _cli(tmp_path, "--config", sharded, "--trainer.max_epochs", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    folders = sorted(p.name for p in (tmp_path / "remote/ckpts").iterdir() if not p.name.startswith("."))
    assert folders == ["epoch=0-step=16.ckpt", "epoch=0-step=8.ckpt"], "16 steps on two ranks, every 8"
    files = sorted(os.listdir(tmp_path / "remote/ckpts/epoch=0-step=8.ckpt"))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__1_1.distcp", "meta.pt"]
    assert len(list((tmp_path / "remote/ckpts/.air").glob("*/manifest.json"))) == 2


def test_fsdp_yaml_overlay_builds_our_fsdp1_strategy_which_refuses_the_cpu_before_training(tmp_path):
    fsdp = os.path.join(REPO, "examples/lightning/fsdp.yaml")
    run = _cli(tmp_path, "--config", fsdp, "--trainer.accelerator", "cpu")
    assert run.returncode != 0
    assert "AirFSDPStrategy: FSDP (FullyShardedDataParallel) needs GPUs" in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "ids.jsonl").exists(), "no training step may run"


@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ("staging_dir: nvme", "staging_dirr: nvme"),
        ("host_budget_bytes: 268435456", "host_budget_bytes: lots"),
        ("preflight: [storage, staging,", "preflight: [storage, disk,"),
    ],
)
def test_mistyped_key_or_value_fails_with_the_cli_error_before_training(tmp_path, good, bad):
    config = open(CONFIG).read()
    assert good in config
    config = config.replace(good, bad)
    path = tmp_path / "bad.yaml"
    path.write_text(config)
    out = subprocess.run(
        [python(), TRAIN, "fit", "--config", str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert out.returncode != 0
    assert bad.split(":")[0] in out.stderr, out.stderr[-2000:]
    if "disk" in bad:  # a value jsonargparse accepts, refused by the callback: naming it and the choices
        assert "unknown check(s) ['disk']" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "ids.jsonl").exists(), "no training step may run"
