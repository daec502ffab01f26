"""Storage faults under a real checkpointer: moto's S3 server behind a fault-injecting proxy, the
``flaky://`` wrapping filesystem, and a staging disk that is full (writes into /dev/full).

Each test asserts what must hold whatever the fault: a save is committed only when every byte is at
the destination (and then verifies), a failed save raises ``SaveError`` naming the fix and leaves the
previous committed checkpoint loadable, and a reader never sees a partial checkpoint.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import tests.faultfs  # noqa: F401  (registers flaky://)
from air_core import AsyncCheckpointer, SaveError
from tests.faults.s3proxy import FaultProxy

BIG = 1 << 20  # a data file of 4 MiB: a dropped connection lands half way through its body


def state(step: int) -> dict:
    return {"w": torch.full((BIG,), float(step)), "step": step}


@pytest.fixture
def proxied(s3_root):
    """(proxy, url, storage_options): an S3 root reached through the fault proxy, short timeouts."""
    proxy = FaultProxy(s3_root.endpoint)
    options = {
        "client_kwargs": {"endpoint_url": proxy.url},
        "config_kwargs": {"read_timeout": 1, "connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    yield proxy, s3_root.url, options
    proxy.close()


def open_ckpt(url, options, tmp_path, **kw) -> AsyncCheckpointer:
    kw = {"retries": 3, "retry_backoff_seconds": 0.05, "keep_last": 3, **kw}
    return AsyncCheckpointer(url, staging_dir=str(tmp_path / "nvme"), storage_options=options, **kw)


def assert_newest_loads(ckpt: AsyncCheckpointer, step: int) -> None:
    info = ckpt.latest()
    assert info is not None and info.step == step
    assert ckpt.verify(info) == ""
    assert torch.equal(ckpt.load(info)["w"], state(step)["w"])


def data_puts(proxy: FaultProxy, action: str) -> int:
    return sum(
        1 for method, path, act in proxy.log if method == "PUT" and act == action and path.endswith(".pt")
    )


@pytest.mark.parametrize(
    ("action", "times", "seconds"),
    [
        ("throttle", 7, 0.0),  # 503 SlowDown, more often than s3fs retries by itself: ours go on
        ("delay", 1, 0.5),  # a latency spike (below the read timeout): no retry needed
        ("drop", 2, 0.0),  # the connection is dropped half way through the upload
        ("hang", 2, 0.0),  # the upload is read and never answered: it times out and is retried
    ],
)
def test_transient_s3_faults_are_retried_and_the_save_commits(proxied, tmp_path, action, times, seconds):
    proxy, url, options = proxied
    with open_ckpt(url, options, tmp_path) as ckpt:
        ckpt.save(state(1), step=1).result(120)
        proxy.add("PUT", "/run/step-000000002/rank-", action, times=times, seconds=seconds)
        ckpt.save(state(2), step=2).result(120)
        assert data_puts(proxy, action) == times
        assert data_puts(proxy, "bad-digest") == 0, "a retried upload sends its whole body again"
        clean = 1 if action == "delay" else 2  # a delayed upload goes through, late
        assert data_puts(proxy, "pass") == clean, "one clean upload per checkpoint, after the faults"
        assert_newest_loads(ckpt, 2)


@pytest.mark.parametrize(
    ("action", "fix"),
    [("deny", "Check the credentials"), ("hang", "Check the root URL, the network")],
)
def test_a_permanent_s3_fault_fails_the_save_and_keeps_the_previous(proxied, tmp_path, action, fix):
    proxy, url, options = proxied
    ckpt = open_ckpt(url, options, tmp_path, retries=0)  # s3fs retries 5 times by itself
    ckpt.save(state(1), step=1).result(120)
    proxy.add("PUT", "/run/step-000000002/rank-", action, times=1000)
    with pytest.raises(SaveError, match=f"step 2.*during upload.*{fix}") as err:
        ckpt.save(state(2), step=2).result(120)
    assert "previous committed checkpoint is untouched" in str(err.value)
    assert [(i.step, i.status) for i in ckpt.list()] == [(1, "committed"), (2, "partial")]
    assert_newest_loads(ckpt, 1)
    proxy.clear()  # the outage ends: the next save commits, retention cleans the partial up
    ckpt.save(state(3), step=3).result(120)
    ckpt.close()
    with AsyncCheckpointer(url, storage_options=options, read_only=True) as reader:
        assert [(i.step, i.status) for i in reader.list()] == [(1, "committed"), (3, "committed")]


@pytest.mark.parametrize(
    ("error", "fix"), [("denied", "Check the credentials"), ("full", "The disk is full")]
)
def test_destination_denied_or_full_fails_the_save_with_the_fix(tmp_path, error, fix):
    root = f"flaky://{tmp_path.name}-{error}/run"
    ckpt = AsyncCheckpointer(root, staging_dir=str(tmp_path / "nvme"), retries=1, retry_backoff_seconds=0.01)
    ckpt.save(state(1), step=1).result(60)
    ckpt.storage.fs.permanent_error = error
    with pytest.raises(SaveError, match=f"during upload.*{fix}"):
        ckpt.save(state(2), step=2).result(60)
    ckpt.storage.fs.permanent_error = ""
    assert_newest_loads(ckpt, 1)
    ckpt.close()


def test_staging_disk_full_fails_the_save_cleans_up_and_recovers(tmp_path, monkeypatch):
    ckpt = AsyncCheckpointer(str(tmp_path / "remote"), staging_dir=str(tmp_path / "nvme"))
    ckpt.save(state(1), step=1).result(60)
    # The staged file of step 2 is written through a link into /dev/full: every write gets ENOSPC.
    dest = ckpt._writer._dest
    temp_paths = dest.temp_paths

    def into_dev_full(files: tuple[str, ...]) -> dict[str, str]:
        temps = temp_paths(files)  # (which removes whatever is there)
        for temp in temps.values():
            os.symlink("/dev/full", temp)
        return temps

    monkeypatch.setattr(dest, "temp_paths", into_dev_full)
    with pytest.raises(SaveError, match="during serialize.*No space left on device.*staging_dir") as err:
        ckpt.save(state(2), step=2).result(60)
    assert isinstance(err.value.__cause__, OSError) and err.value.__cause__.errno == errno.ENOSPC
    staged = os.path.join(ckpt._cache_dir, "step-000000002", "rank-00000.pt")
    assert not os.path.lexists(staged + ".air-tmp"), "no half-written staged file is left behind"
    assert not os.path.exists(staged)
    assert_newest_loads(ckpt, 1)
    monkeypatch.undo()  # space is back: saving goes on
    ckpt.save(state(3), step=3).result(60)
    assert_newest_loads(ckpt, 3)
    ckpt.close()


def test_a_killed_saves_staged_leftover_is_not_uploaded_for_the_next_save_of_its_name(tmp_path, s3_root):
    """A save killed while serializing leaves its staged temp; after the resume, the save of the same name
    (a step's default name) writes to the same path while its upload follows the serializer. The writer
    process opens the file late enough for the upload to have read the leftover's bytes as this save's:
    a corrupt object, committed. Now the leftover is removed first, and the committed object is the
    new bytes."""
    stage = tmp_path / "nvme"
    size = 3 * (16 << 20) // 4  # three upload parts of float32
    options = {"staging_dir": str(stage), "storage_options": s3_root.storage_options, "writer": "process"}
    with AsyncCheckpointer(s3_root.url, **options) as ckpt:
        ckpt.save({"w": torch.zeros(size)}, step=1).result(120)
    (staged,) = stage.glob("*/step-000000001/rank-00000.pt")
    leftover = staged.parent.parent / "step-000000002" / (staged.name + ".air-tmp")
    leftover.parent.mkdir()
    leftover.write_bytes(os.urandom(staged.stat().st_size))  # the killed save of step 2's
    new = {"w": torch.randn(size)}
    with AsyncCheckpointer(s3_root.url, **options) as ckpt:  # the resumed launch: its first save
        ckpt.save(new, step=2).result(120)
    with AsyncCheckpointer(
        s3_root.url, staging_dir=str(tmp_path / "new-node"), storage_options=s3_root.storage_options
    ) as reader:
        newest = reader.latest()
        assert newest is not None and newest.step == 2
        assert reader.verify(newest) == "", "the object at the root is the bytes the manifest names"
        assert torch.equal(reader.load(newest)["w"], new["w"])
