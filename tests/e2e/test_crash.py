"""SIGKILL a writer at each phase of a save: the previous checkpoint stays the newest and loads bitwise."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from air_core import AsyncCheckpointer
from tests.conftest import REPO
from tests.crash_worker import state
from tests.zygote import python

pytestmark = pytest.mark.slow


def _run_until_killed(root: str, staging: str, phase: str, endpoint: str | None = None) -> None:
    args = [python(), os.path.join(REPO, "tests/crash_worker.py"), root, staging, phase]
    out = subprocess.run(
        args + ([endpoint] if endpoint else []),
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert out.returncode == -9, f"the writer must die by SIGKILL at {phase}: {out.stdout}{out.stderr}"
    assert "step 1 committed" in out.stdout and "step 2 committed" not in out.stdout


def _check_recovery(root: str, staging: str, opts: dict) -> None:
    with AsyncCheckpointer(root, staging_dir=staging, storage_options=opts) as ckpt:
        latest = ckpt.latest()
        assert latest is not None and latest.step == 1, f"latest must be the last committed: {ckpt.list()}"
        loaded = ckpt.load()
        assert torch.equal(loaded["w"], state(1)["w"]), "the previous checkpoint must load bitwise equal"
        # The resumed job saves step 2 again over the partial one, and it commits.
        ckpt.save(state(2), step=2).result(timeout=120)
        assert torch.equal(ckpt.load()["w"], state(2)["w"])


@pytest.mark.parametrize("phase", ["serialize_start", "staged", "upload_mid", "uploaded", "commit_start"])
def test_sigkill_during_save_leaves_previous_checkpoint_newest(tmp_path, phase):
    root, staging = str(tmp_path / "remote"), str(tmp_path / "nvme")
    _run_until_killed(root, staging, phase)
    if phase == "upload_mid":  # the kill left a temp file of step 2 at the root
        assert any(".air-tmp-" in f for _, _, files in os.walk(root) for f in files)
    _check_recovery(root, staging, {})


@pytest.mark.parametrize("phase", ["upload_start", "uploaded"])
def test_sigkill_around_the_s3_upload_leaves_previous_checkpoint_newest(tmp_path, s3_root, phase):
    staging = str(tmp_path / "nvme")
    _run_until_killed(s3_root.url, staging, phase, s3_root.endpoint)
    _check_recovery(s3_root.url, str(tmp_path / "other-machine"), s3_root.storage_options)
