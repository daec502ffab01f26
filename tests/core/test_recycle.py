"""A root that recycles its files (``recycle_files``, the local tier's own): each save is written over the
files of the checkpoint it replaced, and every commit still holds exactly its own bytes."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
import torch

from air_core import AsyncCheckpointer, ConfigError
from air_core.config import CheckpointerConfig


def _root(kind: str, tmp_path) -> str:
    if kind == "disk":
        return str(tmp_path / "tier")  # written around the page cache (O_DIRECT)
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    return f"/dev/shm/air-recycle-{uuid.uuid4().hex[:8]}"  # tmpfs: straight into its pages


def _files(step: int) -> dict:
    """Two files per save whose sizes rise and fall from step to step (a recycled file may be longer or
    shorter than what overwrites it)."""
    g = torch.Generator().manual_seed(step)
    n = 4096 * (1 + (step * 7) % 5)
    return {
        f"ck-{step}/model.pt": {"w": torch.randn(n, generator=g), "step": step},
        f"ck-{step}/optimizer.pt": {"m": torch.randn(3 * n + 5, generator=g)},
    }


@pytest.mark.parametrize(("kind", "writer"), [("disk", "thread"), ("shm", "thread"), ("shm", "process")])
def test_each_save_is_written_over_the_files_of_the_one_it_dropped_and_holds_its_own_bytes(
    kind, writer, tmp_path
):
    root = _root(kind, tmp_path)
    inodes: dict[int, dict[str, int]] = {}
    try:
        with AsyncCheckpointer(root, keep_last=1, recycle_files=True, writer=writer) as ckpt:
            for step in range(6):
                info = ckpt.save_files(_files(step), step=step, name=f"ck-{step}").result(timeout=60)
                assert ckpt.verify(info) == "", "every file matches its manifest: size and CRC-32"
                for rel, state in _files(step).items():
                    back = torch.load(os.path.join(root, rel), weights_only=True)
                    assert back.keys() == state.keys()
                    assert all(torch.equal(back[k], v) if torch.is_tensor(v) else back[k] == v
                               for k, v in state.items())  # fmt: skip
                inodes[step] = {
                    rel.split("/")[1]: os.stat(os.path.join(root, rel)).st_ino for rel in _files(step)
                }
        assert sorted(os.listdir(root)) == [".air", "ck-5"], "the older commits dropped, the spares at close"
        for step in range(2, 6):
            assert inodes[step] == inodes[step - 2], "each file lands in the one dropped for it: same inode"
        assert len(set(inodes[0].values()) | set(inodes[1].values())) == 4
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_file_with_another_link_is_removed_not_written_over(tmp_path):
    """A resume's assembly links the tier's files into its own folder: such a file keeps its bytes."""
    root = str(tmp_path / "tier")
    kept = tmp_path / "assembled-model.pt"
    with AsyncCheckpointer(root, keep_last=1, recycle_files=True) as ckpt:
        ckpt.save_files(_files(0), step=0, name="ck-0").result(timeout=60)
        os.link(os.path.join(root, "ck-0/model.pt"), kept)
        for step in (1, 2, 3):
            ckpt.save_files(_files(step), step=step, name=f"ck-{step}").result(timeout=60)
        ckpt.flush()
    back = torch.load(kept, weights_only=True)
    assert torch.equal(back["w"], _files(0)["ck-0/model.pt"]["w"]) and back["step"] == 0
    assert os.stat(kept).st_nlink == 1, "the root's name of it was removed"


def test_a_root_that_does_not_recycle_removes_the_files_it_drops(tmp_path):
    root = tmp_path / "root"
    with AsyncCheckpointer(str(root), keep_last=1) as ckpt:
        for step in (0, 1, 2):
            ckpt.save_files(_files(step), step=step, name=f"ck-{step}").result(timeout=60)
        ckpt.flush()
    assert sorted(p.name for p in root.iterdir()) == [".air", "ck-2"], "no spares kept"


@pytest.mark.parametrize(
    "settings", [{"root": "/tmp/x", "staging_dir": "/tmp/nvme"}, {"root": "s3://bucket/run"}]
)
def test_recycling_is_refused_where_files_are_staged_or_remote(settings):
    with pytest.raises(ConfigError, match="recycle_files"):
        CheckpointerConfig(**settings, recycle_files=True)
