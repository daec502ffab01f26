"""``examples/accelerate/train.py`` runs as documented: with python, and as two CPU processes."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.accelerate.runs import LAUNCH_ARGS
from tests.conftest import REPO
from tests.zygote import python

pytestmark = pytest.mark.slow
EXAMPLE = os.path.join(REPO, "examples/accelerate/train.py")


def run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
    )


def test_example_trains_then_a_relaunch_resumes(tmp_path):
    args = [EXAMPLE, "--root", str(tmp_path / "ckpts"), "--epochs", "1", "--workers", "0"]
    first = run([python(), *args])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "epoch 0: step 32" in first.stdout and "starting fresh" in first.stderr
    again = run([python(), *args[:-4], "--epochs", "2", "--workers", "0"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "epoch 1: step 64" in again.stdout and "starting fresh" not in again.stderr


def test_example_runs_as_two_cpu_processes(tmp_path):
    args = [EXAMPLE, "--root", str(tmp_path / "ckpts"), "--epochs", "1", "--save-every", "8"]
    out = run([python(), *LAUNCH_ARGS, *args], env={"ACCELERATE_USE_CPU": "true"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "epoch 0: step 16" in out.stdout, "two ranks share the 32 batches of an epoch"
    assert sorted(os.listdir(tmp_path / "ckpts/step-000000016")) == [
        "air-rank-00000.pt",
        "air-rank-00001.pt",
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "scheduler.bin",
    ]


def test_a_launch_whose_processes_do_not_form_one_job_is_refused(tmp_path):
    # Without cpu=True or ACCELERATE_USE_CPU, Accelerate on a machine without GPUs runs each launched
    # process alone: both would write the same checkpoints.
    out = run(
        [python(), *LAUNCH_ARGS, EXAMPLE, "--root", str(tmp_path / "ckpts"), "--epochs", "1"],
        env={"ACCELERATE_USE_CPU": "false"},
    )
    assert out.returncode != 0
    assert "launched as 2 processes (WORLD_SIZE) but Accelerate runs this one as 1 of 1" in out.stderr, (
        out.stderr[-4000:]
    )
    assert not (tmp_path / "ckpts").exists() or not any((tmp_path / "ckpts").iterdir()), "nothing written"
