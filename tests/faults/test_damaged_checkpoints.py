"""A committed checkpoint damaged afterwards (a file removed, one byte changed) is detected at resume:
the job falls back to the previous committed checkpoint with a warning that says why, and ends as the
uninterrupted run does. (On the node that wrote it, an intact cached copy is preferred and loads.)"""

from __future__ import annotations

import os
import shutil

import pytest

from air_core.recovery import scan
from air_core.storage import Storage
from tests.faults.trials import Plan, launch
from tests.sameness import assert_same_run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("adapter", ["lightning", "accelerate"])
@pytest.mark.parametrize(
    ("damage", "why"), [("flip", "does not match its manifest"), ("remove", "is missing")]
)
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, clean_run, adapter, damage, why):
    plan = Plan(adapter, 0, workers=0, s3=False, processes=1, launches=[])
    rc, stderr = launch(plan, tmp_path, [], None)
    assert rc == 0, stderr[-3000:]
    root = tmp_path / "ckpts"
    newest = [i for i in scan(Storage(str(root), storage_options={}, retries=0, retry_backoff_seconds=0))][-1]
    assert newest.status == "committed" and newest.manifest is not None
    victim = root / max(newest.manifest.files, key=lambda f: f.size).path
    if damage == "flip":
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
    else:
        victim.unlink()
    shutil.rmtree(tmp_path / "nvme")  # the relaunch lands on a new node: no intact cached copy to prefer
    rc, stderr = launch(plan, tmp_path, [], None)  # resumes from the previous checkpoint, redoes 4 steps
    assert rc == 0, stderr[-3000:]
    warning = [line for line in stderr.splitlines() if f"skipping checkpoint {newest.name}" in line]
    assert warning and why in warning[0], stderr[-3000:]
    assert_same_run(tmp_path, clean_run(plan))
