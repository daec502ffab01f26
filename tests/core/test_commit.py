"""A checkpoint commits only when every rank's part is at the destination (2 gloo processes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from air_core import AsyncCheckpointer
from tests.conftest import REPO
from tests.dist_worker import rank_state

pytestmark = pytest.mark.slow


def _launch(root: str, tmp_path, scenario: str) -> list[subprocess.CompletedProcess]:
    init = tmp_path / f"init-{scenario}"
    env = {**os.environ, "PYTHONPATH": REPO}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(REPO, "tests/dist_worker.py"),
                str(r),
                "2",
                root,
                str(init),
                scenario,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs


@pytest.mark.parametrize("scenario", ["ok", "slow"])
def test_manifest_lists_every_ranks_part_and_each_rank_loads_its_own(tmp_path, scenario):
    root = str(tmp_path / "root")
    outs = _launch(root, tmp_path, scenario)
    for r, out in enumerate(outs):
        assert out.returncode == 0, out.stderr
        assert f"rank {r} committed step 2" in out.stdout, out.stdout + out.stderr
    reader = AsyncCheckpointer(root)
    info = reader.latest()
    assert info.step == 2 and info.manifest.world_size == 2
    assert sorted(f.rank for f in info.manifest.files) == [0, 1], "the commit waits for both ranks' parts"
    reader.close()
    for r in range(2):
        with AsyncCheckpointer(root, rank=r, world_size=2, launch_id="reader") as ckpt:
            loaded = ckpt.load()
        assert loaded["rank"] == r and torch.equal(loaded["w"], rank_state(r, 2)["w"])


def test_rank_killed_before_its_part_leaves_the_previous_checkpoint_newest(tmp_path):
    root = str(tmp_path / "root")
    rank0, rank1 = _launch(root, tmp_path, "die")
    assert rank1.returncode == -9, "rank 1 was SIGKILLed"
    assert "rank 0 step 2 failed: SaveError" in rank0.stdout and "ranks [1] never uploaded" in rank0.stdout
    with AsyncCheckpointer(root) as reader:
        statuses = {i.step: i.status for i in reader.list()}
        assert statuses == {1: "committed", 2: "partial"}
        assert reader.latest().step == 1
