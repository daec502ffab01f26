"""A staged save to a local root: handed over by hard link on one filesystem, copied across devices, and
nothing lost when a link or rename fails halfway through a save's files."""

from __future__ import annotations

import errno
import io
import logging
import os
import time

import pytest
import torch

from air_core import AsyncCheckpointer, SaveError, SaveRecord
from air_core import storage as storage_module

FILES = ("ck/a.pt", "ck/b.pt", "ck/c.pt")


class Records:
    def __init__(self):
        self.saves: list[SaveRecord] = []

    def on_event(self, event):
        if isinstance(event, SaveRecord):
            self.saves.append(event)


def _files(step: int) -> dict[str, dict]:
    return {rel: {"w": torch.full((256, 256), float(step * 10 + i))} for i, rel in enumerate(FILES)}


def _save(ckpt: AsyncCheckpointer, step: int):
    return ckpt.save_files({f.replace("ck", f"ck{step}"): v for f, v in _files(step).items()}, step=step)


def _staged_and_root(ckpt: AsyncCheckpointer, root: str, info) -> list[tuple[os.stat_result, os.stat_result]]:
    out = []
    for entry in info.manifest.files:
        cached = os.path.join(ckpt._cache_dir, entry.path)
        out.append((os.stat(cached), os.stat(os.path.join(root, entry.path))))
    return out


def _check_loads(ckpt: AsyncCheckpointer, info, step: int) -> None:
    paths = ckpt.fetch(info, ranks=[0]).paths
    for i, entry in enumerate(info.manifest.files):
        loaded = torch.load(paths[entry.path], weights_only=True)
        assert torch.equal(loaded["w"], torch.full((256, 256), float(step * 10 + i))), entry.path


def test_same_filesystem_links_the_staged_files_into_the_root(tmp_path):
    records = Records()
    root = str(tmp_path / "root")
    with AsyncCheckpointer(root, staging_dir=str(tmp_path / "stage"), listeners=[records]) as ckpt:
        info = _save(ckpt, 1).result(timeout=60)
        for staged, at_root in _staged_and_root(ckpt, root, info):
            assert staged.st_ino == at_root.st_ino and at_root.st_nlink == 2, "linked, not copied"
        _check_loads(ckpt, info, 1)
    (record,) = records.saves
    assert record.staged_bytes == record.bytes == record.linked_bytes > 0
    assert record.uploaded_bytes == 0
    assert not [p for p in os.listdir(os.path.join(root, "ck1")) if p.startswith(".")], "no temp file stays"


def test_another_device_gets_a_copy(tmp_path):
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.fail("the test needs /dev/shm on a filesystem of its own (a tmpfs), as on Linux")
    records = Records()
    root = str(tmp_path / "root")
    stage = os.path.join(shm, f"air-test-{os.getpid()}-{tmp_path.name}")
    try:
        with AsyncCheckpointer(root, staging_dir=stage, listeners=[records]) as ckpt:
            info = _save(ckpt, 1).result(timeout=60)
            for staged, at_root in _staged_and_root(ckpt, root, info):
                assert staged.st_dev != at_root.st_dev and at_root.st_nlink == 1
            _check_loads(ckpt, info, 1)
    finally:
        import shutil

        shutil.rmtree(stage, ignore_errors=True)
    (record,) = records.saves
    assert record.uploaded_bytes == record.bytes > 0 and record.linked_bytes == 0


def test_a_filesystem_that_refuses_links_gets_a_copy(tmp_path, monkeypatch):
    """A bind mount of the same disk has the same device number, and ``link`` fails with EXDEV."""

    def refuse(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(storage_module.os, "link", refuse)
    records = Records()
    root = str(tmp_path / "root")
    with AsyncCheckpointer(root, staging_dir=str(tmp_path / "stage"), listeners=[records]) as ckpt:
        info = _save(ckpt, 1).result(timeout=60)
        for staged, at_root in _staged_and_root(ckpt, root, info):
            assert staged.st_ino != at_root.st_ino and at_root.st_nlink == 1
        _check_loads(ckpt, info, 1)
    assert records.saves[0].uploaded_bytes == records.saves[0].bytes


@pytest.mark.parametrize("fails", ["link", "rename"])
def test_a_link_or_rename_that_fails_halfway_loses_nothing(tmp_path, monkeypatch, fails):
    root = str(tmp_path / "root")
    real = {"link": os.link, "rename": os.replace}[fails]
    calls = []

    def second_fails(src, dst):  # the second file of save 2 to reach the root
        if str(dst).startswith(os.path.join(root, "ck2")):
            calls.append(dst)
            if len(calls) == 2:
                raise OSError(errno.EACCES if fails == "link" else errno.EROFS, f"{fails} refused (test)")
        return real(src, dst)

    with AsyncCheckpointer(root, staging_dir=str(tmp_path / "stage"), keep_last=3) as ckpt:
        first = _save(ckpt, 1).result(timeout=60)
        monkeypatch.setattr(storage_module.os, "link" if fails == "link" else "replace", second_fails)
        with pytest.raises(SaveError, match=f"{fails} refused"):
            _save(ckpt, 2).result(timeout=60)
        monkeypatch.undo()
        assert ckpt.latest().name == first.name, "the failed save is not committed"
        _check_loads(ckpt, first, 1)
        leftovers = [n for _, _, names in os.walk(root) for n in names if ".air-tmp" in n]
        assert not leftovers, f"no temp file of the failed hand-over stays: {leftovers}"
        again = _save(ckpt, 2).result(timeout=60)  # the same save, once the filesystem allows it
        _check_loads(ckpt, again, 2)
        assert ckpt.latest().name == again.name


def test_a_checkpoint_deleted_from_the_root_leaves_the_cache_too(tmp_path):
    """Lightning's ``save_top_k`` deletes through ``delete()`` with retention by count off: the cache's copy
    (a link to the same blocks here) must go as well, or the root's deletes free no disk."""
    root, stage = str(tmp_path / "root"), str(tmp_path / "stage")
    with AsyncCheckpointer(root, staging_dir=stage, keep_last=1 << 30) as ckpt:
        first = _save(ckpt, 1).result(timeout=60)
        _save(ckpt, 2).result(timeout=60)
        assert ckpt.delete(first.name).wait(60)
        assert [i.step for i in ckpt.list()] == [2]
        cache = ckpt._cache_dir
        cached = [os.path.relpath(os.path.join(d, f), cache) for d, _, fs in os.walk(cache) for f in fs]
    assert [p for p in cached if p.startswith("ck2/")], "the kept one's copy stays"
    assert not [p for p in cached if p.startswith("ck1/") or first.name in p], cached
    assert all(os.stat(os.path.join(root, f)).st_nlink == 2 for f in ("ck2/a.pt", "ck2/b.pt")), "the kept one"


def _cached_steps(cache_dir: str) -> list[int]:
    """The steps of the checkpoints a cache holds files of (``ck<step>/``)."""
    held = [d for d in os.listdir(cache_dir) if d.startswith("ck") and os.listdir(os.path.join(cache_dir, d))]
    return sorted(int(d[2:]) for d in held)


def test_the_cache_keeps_the_newest_two_whatever_the_root_keeps(tmp_path, caplog):
    """A keep-all root (Lightning's ``save_top_k=-1``, retention by count off) to a disk apart from the
    staging one: the root keeps every checkpoint, the cache only the newest two, and the older ones still
    load, from the root. The cache's trimming says nothing of a deleted checkpoint (none was)."""
    root, stage = f"memory://keepall-{tmp_path.name}", str(tmp_path / "stage")
    with caplog.at_level(logging.INFO), AsyncCheckpointer(root, staging_dir=stage, keep_last=1 << 30) as ckpt:
        infos = [_save(ckpt, step).result(timeout=60) for step in (1, 2, 3, 4)]
    assert _cached_steps(ckpt._cache_dir) == [3, 4], "trimmed after the last commit, by close at the latest"
    assert "deleted checkpoint" not in caplog.text
    with AsyncCheckpointer(root, staging_dir=stage) as ckpt:
        assert [i.step for i in ckpt.list()] == [1, 2, 3, 4]
        _check_loads(ckpt, infos[0], 1)


def test_a_node_apart_from_rank_0s_keeps_no_more_than_two_of_the_checkpoints_deleted_by_name(tmp_path):
    """Two ranks as two nodes (a staging folder each). Rank 0 deletes by name (Lightning's ``save_top_k``),
    and only its node's cache hears of it; the other node's cache still holds at most the newest two."""
    root = f"memory://nodes-{tmp_path.name}"
    ranks = [
        AsyncCheckpointer(
            root,
            staging_dir=str(tmp_path / f"node{r}"),
            rank=r,
            world_size=2,
            launch_id="L",
            keep_last=1 << 30,
        )
        for r in range(2)
    ]
    previous = None
    for step in range(1, 7):
        handles = [ckpt.save({"w": torch.full((64,), float(step))}, step=step) for ckpt in ranks]
        infos = [h.result(timeout=60) for h in handles]
        if previous is not None:
            assert ranks[0].delete(previous.name).wait(60)
        previous = infos[0]
    for ckpt in reversed(ranks):
        ckpt.close()
    with AsyncCheckpointer(root, read_only=True) as reader:
        assert [i.step for i in reader.list()] == [6]
    cached = [sorted(d for d in os.listdir(ckpt._cache_dir) if not d.startswith(".")) for ckpt in ranks]
    assert len(cached[0]) == 1 and len(cached[1]) == 2, cached


@pytest.mark.parametrize("root_kind", ["local", "memory"])
def test_a_file_rewritten_at_the_root_after_its_commit_is_never_served_stale_from_the_cache(
    tmp_path, root_kind
):
    """Another writer (a stock ``Trainer.save_checkpoint`` to the same path) replaces a committed file with
    one of the same size: the listing still says committed, and the cache held the commit's bytes, which
    a load returned as if they were the file's. It now reads the root and finds the change."""
    from air_core import CorruptCheckpointError

    root = str(tmp_path / "root") if root_kind == "local" else f"memory://rewritten-{tmp_path.name}"
    with AsyncCheckpointer(root, staging_dir=str(tmp_path / "stage")) as ckpt:
        info = _save(ckpt, 1).result(timeout=60)
        _check_loads(ckpt, info, 1)  # from the cache
        victim = "ck1/a.pt"
        time.sleep(0.05)  # a later write than the manifest's, whatever the clock's resolution
        buffer = io.BytesIO()
        torch.save({"w": torch.full((256, 256), 99.0)}, buffer)
        assert len(buffer.getvalue()) == ckpt.storage.size(victim), "the same size: the listing cannot tell"
        ckpt.storage.write_bytes(victim, buffer.getvalue())  # a new file in its place, as a stock save
        (listed,) = ckpt.list()
        assert listed.status == "committed"
        with pytest.raises(CorruptCheckpointError, match="does not match its manifest"):
            ckpt.fetch(listed, ranks=[0])
