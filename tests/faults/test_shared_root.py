"""Two jobs writing one root: the second is refused before any step, a dead holder is taken over at
once (same host) or after its lease lapses (another host), and a job that lost its root stops writing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from air_core import AsyncCheckpointer, ConfigError, SaveError
from air_core.lease import LEASE_PATH, StorageLost
from tests.conftest import REPO
from tests.zygote import python

HOLDER = """
import socket, sys
from air_core import AsyncCheckpointer
if sys.argv[2:]:  # pretend to run on another host
    socket.gethostname = lambda: sys.argv[2]
ckpt = AsyncCheckpointer(sys.argv[1], lease_seconds=1.5)
ckpt.save({"w": 1}, step=1).result(60)
print("holding", flush=True)
sys.stdin.read()  # until the test closes stdin (or kills this process)
ckpt.close()
"""


def start_holder(root: str, host: str = "") -> subprocess.Popen:
    # A fresh interpreter, not tests/zygote.py's: killing a zygote launcher kills its program a moment
    # later, and the tests take over the root as soon as the holder's kill returns.
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, root, *([host] if host else [])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
    return proc


def test_a_second_writer_is_refused_and_a_killed_holder_is_taken_over_at_once(tmp_path):
    root = str(tmp_path / "root")
    holder = start_holder(root)
    try:
        with pytest.raises(
            ConfigError, match="is writing checkpoints to this root now.*its own root"
        ) as error:
            AsyncCheckpointer(root)
        # a notebook whose interrupted AirAccelerator still holds the root (a live process on this host)
        assert "AirAccelerator.end_training(), or restart the kernel" in str(error.value)
        with AsyncCheckpointer(root, read_only=True) as reader:  # tools may still look
            assert [i.step for i in reader.list()] == [1]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    started = time.monotonic()
    with AsyncCheckpointer(root) as ckpt:  # the holder's pid is gone: no wait for its lease to lapse
        assert time.monotonic() - started < 5
        ckpt.save({"w": 2}, step=2).result(60)
        assert ckpt.latest().step == 2


def test_a_second_writer_in_the_same_process_takes_the_root_over_after_the_first_commits(tmp_path):
    first = AsyncCheckpointer(str(tmp_path))  # a notebook's first Trainer, never torn down
    first.save({"w": torch.ones(1000)}, step=1)
    with AsyncCheckpointer(str(tmp_path)) as second:  # its second Trainer, same folder
        assert first.closed, "the earlier writer handed the root over"
        assert [(i.step, i.status) for i in second.list()] == [(1, "committed")]
        second.save({"w": 2}, step=2).result(60)
    first.close()  # idempotent
    with AsyncCheckpointer(str(tmp_path), read_only=True) as reader:
        assert [i.step for i in reader.list() if i.status == "committed"] == [1, 2]


def test_a_clean_close_releases_the_root(tmp_path):
    root = str(tmp_path / "root")
    holder = start_holder(root)
    holder.communicate("")  # closes stdin: the holder closes its checkpointer and exits
    assert holder.returncode == 0
    with AsyncCheckpointer(root) as ckpt:
        assert ckpt.latest().step == 1


def test_a_live_holder_on_another_host_is_refused_a_dead_one_taken_over(tmp_path, caplog):
    root = str(tmp_path / "root")
    holder = start_holder(root, host="other-host")  # its lease thread renews every 0.5 s
    try:
        with pytest.raises(ConfigError, match="host other-host"):
            AsyncCheckpointer(root, lease_seconds=1.5)
    finally:
        holder.send_signal(signal.SIGKILL)  # its host is not ours: only the silent lease tells
        holder.wait()
    started = time.monotonic()
    with AsyncCheckpointer(root, lease_seconds=1.5) as ckpt:
        assert time.monotonic() - started >= 1.5, "taken over only after lease_seconds without a renewal"
        ckpt.save({"w": 2}, step=2).result(60)
    assert "did not renew its lease" in caplog.text


def _other_host_lease(root: str) -> None:
    body = {"launch_id": "f" * 32, "host": "other-host", "pid": 1, "pid_started": "", "count": 1}
    body |= {"renewed": time.time(), "released": False}
    with open(os.path.join(root, LEASE_PATH), "w") as f:
        json.dump(body, f)


def test_a_job_whose_root_was_taken_over_stops_writing_there(tmp_path):
    root = str(tmp_path / "root")
    ckpt = AsyncCheckpointer(root, keep_last=1)
    ckpt.save({"w": torch.ones(4)}, step=1).result(60)
    _other_host_lease(root)  # as if another job took over while this one could not renew
    handle = ckpt.save({"w": torch.zeros(4)}, step=2)
    with pytest.raises(SaveError) as err:
        handle.result(60)
    assert isinstance(err.value.__cause__, StorageLost), err.value
    assert "no longer holds" in str(err.value) and "stop one of them" in str(err.value)
    assert not os.path.exists(os.path.join(root, "step-000000002")), "nothing of the save was written"
    ckpt.close()
    with AsyncCheckpointer(root, read_only=True) as reader:
        assert [(i.step, i.status) for i in reader.list()] == [(1, "committed")]
        assert torch.equal(reader.load()["w"], torch.ones(4))


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["lightning", "accelerate"])
def test_a_training_job_on_a_root_in_use_is_refused_before_any_step(tmp_path, adapter):
    root = str(tmp_path / "ckpts")
    holder = start_holder(root)
    try:
        out = subprocess.run(
            [python(), os.path.join(REPO, f"tests/{adapter}/job.py"), str(tmp_path), "--root", root],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": REPO},
        )
    finally:
        holder.communicate("")
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("air_core.errors.ConfigError") and "is writing checkpoints to this root now" in last
    )
    assert not (tmp_path / "ids-rank0.jsonl").exists(), "no training step may run"
