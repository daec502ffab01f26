"""A checkpoint commits only when every rank's part is at the destination (2 gloo processes), and a
commit lists the root once."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import threading
import uuid

import fsspec
import pytest
import torch
import torch.distributed as dist
from fsspec.implementations.memory import MemoryFileSystem

from air_core import AsyncCheckpointer, FileEntry, commit, procfs
from air_core.errors import StorageError
from air_core.manifest import PartRecord
from air_core.storage import Storage
from tests.conftest import REPO, spawn_ranks
from tests.dist_worker import rank_state
from tests.torchrun_nodes import free_port
from tests.zygote import python


def _launch(
    root: str, tmp_path, scenario: str, nodes: str = "", world: int = 2
) -> list[subprocess.CompletedProcess]:
    """Run ``world`` ranks of ``tests/dist_worker.py``; ``nodes``: each rank's ``AIR_NODE_NAME``, in order."""
    init = tmp_path / f"init-{scenario}"
    procs = [
        subprocess.Popen(
            [
                python(),
                os.path.join(REPO, "tests/dist_worker.py"),
                str(r),
                str(world),
                root,
                str(init),
                scenario,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": REPO, **({"AIR_NODE_NAME": nodes[r]} if nodes else {})},
        )
        for r in range(world)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("far", [False, True], ids=["one-host", "two-hosts"])
@pytest.mark.parametrize("dead", [1, 0])
def test_a_rank_killed_in_a_save_fails_it_on_the_other_at_once(tmp_path, dead, far):
    """Rank 1 killed before its part (rank 0 waits for it), or rank 0 killed as it commits (rank 1 waits for
    the manifest): the survivor sees the dead process instead of waiting for its commit timeout (120 s
    here; the result is awaited 60 s). On one host through /proc (the process its part record names); each
    rank on a "node" of its own (``AIR_NODE_NAME``: a pid of one means nothing on the other), through its
    liveness beacon (``liveness.py``), whose connection the survivor made at the start closes with it.
    The previous checkpoint stays the newest."""
    root = str(tmp_path / "root")
    scenario = ("far" if far else "die") + ("0" if dead == 0 else "")
    outs = _launch(root, tmp_path, scenario, nodes="ab" if far else "")
    survivor = outs[1 - dead]
    assert outs[dead].returncode == -9, "the rank was SIGKILLed"
    assert survivor.returncode == 0, survivor.stderr
    pid = outs[dead].stdout.split(f"rank {dead} pid ")[1].split()[0]
    assert f"rank {1 - dead} step 2 failed: SaveError" in survivor.stdout, survivor.stdout
    assert f"rank {dead} (pid {pid} on host {socket.gethostname()}) died before" in survivor.stdout, (
        survivor.stdout
    )
    with AsyncCheckpointer(root) as reader:
        statuses = {i.step: i.status for i in reader.list()}
        assert statuses == {1: "committed", 2: "partial"}
        assert reader.latest().step == 1


@pytest.mark.slow
def test_a_rank_killed_before_its_part_is_reported_by_its_host_to_rank_0_on_another(tmp_path):
    """Ranks 1 and 2 on node b, rank 0 on node a (``AIR_NODE_NAME``: a pid of b means nothing on a). Rank 1
    is killed before its part; rank 0 cannot reach its liveness beacon (as across a firewall), so rank 2
    sees it gone and records its death, which rank 0 reads as rank 1's failure instead of waiting for its
    commit timeout (120 s; the result is awaited 60 s)."""
    root = str(tmp_path / "root")
    outs = _launch(root, tmp_path, "witness", nodes="abb", world=3)
    assert outs[1].returncode == -9, "rank 1 was SIGKILLed"
    pid = outs[1].stdout.split("rank 1 pid ")[1].split()[0]
    died = f"rank 1 (pid {pid} on host {socket.gethostname()}) died before its part"
    for rank in (0, 2):
        assert outs[rank].returncode == 0, outs[rank].stderr
        assert f"rank {rank} step 2 failed: SaveError" in outs[rank].stdout, outs[rank].stdout
        assert died in outs[rank].stdout and "(seen by rank 2, on its host)" in outs[rank].stdout, outs[
            rank
        ].stdout
    assert "rank 1 failed its part of checkpoint 'step-000000002'" in outs[0].stdout, outs[0].stdout
    with AsyncCheckpointer(root) as reader:
        assert {i.step: i.status for i in reader.list()} == {1: "committed", 2: "partial"}


@pytest.mark.slow
@pytest.mark.parametrize("failing", [0, 1])
def test_a_ranks_failed_part_fails_the_save_on_every_rank_at_once(tmp_path, failing):
    """The other rank learns of the failure from the failing rank's record, not from its commit timeout
    (120 s here; the saves' results are awaited 60 s): rank 0 waiting for parts, or a rank waiting for
    the commit, while its buffers hold its next save back. Then both save it again."""
    root = str(tmp_path / "root")
    outs = _launch(root, tmp_path, f"fail{failing}")
    for out in outs:
        assert out.returncode == 0, out.stderr
    failed, other = outs[failing], outs[1 - failing]
    assert f"rank {failing} step 2 failed: SaveError: rank {failing}: saving checkpoint" in failed.stdout
    assert "IsADirectoryError" in failed.stdout, failed.stdout
    waiting = (
        "rank 0 did not commit checkpoint 'step-000000002'"
        if failing == 0
        else "rank 1 failed its part of checkpoint 'step-000000002'"
    )
    assert f"rank {1 - failing} step 2 failed: SaveError" in other.stdout and waiting in other.stdout, (
        other.stdout
    )
    # Saved again under the same name, neither rank takes the first attempt's records for the second's.
    for rank, out in enumerate(outs):
        assert f"rank {rank} committed step 2 at the second attempt" in out.stdout, out.stdout
    with AsyncCheckpointer(root) as reader:
        assert {i.step: i.status for i in reader.list()} == {1: "committed", 2: "committed"}
    for r in range(2):
        with AsyncCheckpointer(root, rank=r, world_size=2, launch_id="reader") as ckpt:
            assert torch.equal(ckpt.load()["w"], rank_state(r, 2)["w"])


class _ListingCounter(MemoryFileSystem):
    """Memory storage that records every listing, counting a lookup of a missing path as one: that is
    what an object store answers it with (s3fs lists the prefix when a HEAD finds no key)."""

    protocol = "listcount"
    root_marker = "/"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.listings: list[tuple[str, str]] = []
        self._depth = threading.local()

    @contextlib.contextmanager
    def _call(self):
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        try:
            yield depth == 0  # only the outermost call counts, not what fsspec does inside it
        finally:
            self._depth.n = depth

    def find(self, path, *args, **kw):
        with self._call() as outer:
            if outer:
                self.listings.append(("find", path))
            return super().find(path, *args, **kw)

    def ls(self, path, *args, **kw):
        with self._call() as outer:
            if outer:
                self.listings.append(("ls", path))
            return super().ls(path, *args, **kw)

    def info(self, path, **kw):
        with self._call() as outer:
            try:
                return super().info(path, **kw)
            except FileNotFoundError:
                if outer:
                    self.listings.append(("lookup of a missing path", path))
                raise

    def _quiet(name):  # reads, writes and deletes are not listings, whatever they call inside
        def call(self, *args, **kw):
            with self._call():
                return getattr(MemoryFileSystem, name)(self, *args, **kw)

        return call

    cat_file = _quiet("cat_file")
    pipe_file = _quiet("pipe_file")
    put_file = _quiet("put_file")
    get_file = _quiet("get_file")
    rm = _quiet("rm")


fsspec.register_implementation("listcount", _ListingCounter, clobber=True)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_commit_lists_the_root_once_and_only_on_rank_0(tmp_path, world_size):
    root = f"listcount://lc-{uuid.uuid4().hex[:8]}"
    ranks = [
        AsyncCheckpointer(
            root,
            staging_dir=str(tmp_path / f"r{r}"),
            rank=r,
            world_size=world_size,
            launch_id="L",
            keep_last=1,
        )
        for r in range(world_size)
    ]
    # A stale partial (an intent record and its file) for retention to delete along the way.
    storage = ranks[0].storage
    storage.write_bytes("old/rank-00000.pt", b"x")
    intent = PartRecord("old", 0, 0, "x", (FileEntry("old/rank-00000.pt", -1, 0, 0),), complete=False)
    storage.write_bytes(".air/old/rank-00000.json", intent.to_json())
    for ckpt in ranks:
        ckpt.storage.fs.listings.clear()
    for step in (1, 2, 3):
        handles = [ckpt.save({"w": torch.full((8,), float(step))}, step=step) for ckpt in ranks]
        for h in handles:
            h.result(timeout=60)
    for ckpt in reversed(ranks):
        ckpt.close()  # waits for the retention that follows each commit
    listings = [ckpt.storage.fs.listings for ckpt in ranks]
    # and one of the records' folder as the lease goes (``RootLease.release``: is it all that is left?)
    assert listings[0][-1] == ("find", f"{root}/.air"), listings[0]
    listings[0].pop()
    assert len(listings[0]) == 3, f"rank 0: one listing per commit (3 commits), got {listings[0]}"
    assert all(not seen for seen in listings[1:]), f"ranks > 0 never list the root: {listings[1:]}"
    with AsyncCheckpointer(root, read_only=True) as reader:
        assert [(i.name, i.status) for i in reader.list()] == [("step-000000003", "committed")], (
            "retention (keep_last=1) and the stale partial's cleanup ran from that one listing"
        )
    assert not storage.fs.exists(storage.path("old/rank-00000.pt")), "the partial's file is deleted"


def _session_worker(rank: int, port: int, folder: str) -> None:
    from air_core.session import SessionConfig, TrainingSession

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def broadcast(value: str) -> str:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    session = TrainingSession(
        SessionConfig(mlflow=False, preflight=False, owner="test"),
        rank=rank,
        world_size=2,
        broadcast=broadcast,
    )
    peers = session.open(os.path.join(folder, "root")).config.peers
    with open(os.path.join(folder, f"peers-{rank}.json"), "w") as f:
        json.dump([[p.pid, p.started, p.space] for p in peers], f)
    session.close(0)
    dist.destroy_process_group()


def test_a_session_gives_its_checkpointers_every_rank_s_process(tmp_path):
    """Where the ranks broadcast the launch id over the default group, the session gathers every rank's
    process there too, so that its commits see a rank of this host die without a record of it."""
    spawn_ranks(_session_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    seen = [json.loads((tmp_path / f"peers-{rank}.json").read_text()) for rank in range(2)]
    assert seen[0] == seen[1] and len(seen[0]) == 2, seen
    (pid0, _, space0), (pid1, _, space1) = seen[0]
    assert pid0 != pid1 and space0 == space1 == procfs.pid_space(), "two processes of this host"


@pytest.mark.parametrize("rank", [0, 1])
def test_a_long_commit_wait_says_what_it_waits_for_before_it_gives_up(tmp_path, monkeypatch, caplog, rank):
    """Rank 0 waiting for a part, or rank 1 for the manifest, names what is missing while it waits."""
    monkeypatch.setattr(commit, "NOTE_AFTER_SECONDS", 0.1)
    storage = Storage(str(tmp_path), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    own = PartRecord("step-1", 1, rank, "launch", (), complete=True)
    with caplog.at_level(logging.WARNING, logger="air_core.commit"), pytest.raises(StorageError):
        if rank == 0:
            commit.wait_for_parts(storage, own, world_size=2, timeout_seconds=0.6)
        else:
            commit.wait_for_manifest(storage, own, timeout_seconds=0.6)
    said = "no part yet from ranks [1]" if rank == 0 else "rank 0 has written neither the manifest"
    assert any("still waiting for" in r.message and said in r.message for r in caplog.records), caplog.text
