"""The local tier's pieces without processes: which step a resume agrees on, copies checked and placed
as commits, retention, partners and the settings' errors."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import zlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from air_core import AsyncCheckpointer, ConfigError, CorruptCheckpointError
from air_core import dcp as air_dcp
from air_core.catalog import read_catalog
from air_core.manifest import FileEntry
from air_core.session import SessionConfig
from air_core.side_groups import side_group
from air_core.staging import matches
from air_core.tiers import Held, choose, holdings, recover, tier_name
from air_core.tiers.partners import partners, sources
from air_core.tiers.recover import _bring_plan, _plan, _receivers, _rounds
from air_core.tiers.transfer import EMPTY, Package, StagedFiles, exchange, local_storage, read_package
from tests.conftest import spawn_ranks
from tests.gloo_exit import exit_without_teardown
from tests.sameness import assert_same_state
from tests.sharded_worker import Fetched, build, train_step
from tests.torchrun_nodes import free_port


def held(saved: int, step: int, world: int = 2, kind: str = "local") -> Held:
    return Held(saved, step, world, kind, "/nowhere", "n")  # type: ignore[arg-type]


def test_the_newest_step_every_saved_rank_has_a_part_of_wins_and_steps_never_mix():
    a = [held(0, 8), held(0, 10), held(1, 8, kind="replica")]  # node A: B's copy of step 10 never came
    assert choose([a], newer_than=5) == (8, 2), "step 10 lacks rank 1's part: the newest complete is 8"
    assert choose([a, [held(1, 10)]], newer_than=5) == (10, 2), "with B's own part step 10 is complete"
    assert choose([a], newer_than=8) is None, "the root's newer or equal commit wins"
    assert choose([[held(0, 12, world=1)], a], newer_than=None) == (12, 1), "one world size per step"
    assert choose([[]], newer_than=None) is None


def test_partners_sit_on_other_nodes_and_sources_are_their_inverse():
    assert partners(0, 8, 4, 1) == [4] and partners(5, 8, 4, 1) == [1]
    assert partners(1, 6, 2, 2) == [3, 5] and sources(3, 6, 2, 2) == [1, 5]
    assert all(r in partners(s, 6, 2, 2) for r in range(6) for s in sources(r, 6, 2, 2))


def _committed(root: str, step: int) -> str:
    with AsyncCheckpointer(root) as ckpt:
        state = {"w": torch.arange(3_000_000.0) + step}  # 12 MB: more than one message of the transfer
        ckpt.save_files(
            {f"step-{step}/w.pt": state, f"step-{step}/empty.txt": {}}, step=step, name=tier_name(step, 1)
        )
    return tier_name(step, 1)


def _damaged(package: Package) -> Package:
    body = json.loads(package.manifest)
    body["files"][0]["crc32"] ^= 1
    return dataclasses.replace(package, manifest=json.dumps(body).encode())


def _copy_worker(rank: int, port: int, folder: str, threads: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = side_group(60)
    own, replica = os.path.join(folder, "own"), local_storage(os.path.join(folder, "replica-00000"))
    seen = []
    for step in (3, 4, 5, 6):
        if rank == 0:
            package = read_package(local_storage(own), _committed(own, step))
            exchange(_damaged(package) if step == 3 else package, [1], {}, group)
            continue
        sink = StagedFiles(replica)
        got = exchange(EMPTY, [], {0: sink}, group, threads=threads)[0]
        try:
            sink.commit(got)
            outcome = "committed"
        except CorruptCheckpointError:
            outcome = "refused"
        names = [i.name for i in read_catalog(replica).committed]
        inode = os.stat(replica.path(f"step-{step}/w.pt")).st_ino if outcome == "committed" else None
        seen.append([step, outcome, names, inode])
    if rank == 1:
        with open(os.path.join(folder, "seen.json"), "w") as f:
            json.dump(seen, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("threads", [1, 3], ids=["checked-on-one-thread", "checked-on-three-threads"])
def test_a_copy_between_two_processes_is_committed_only_when_every_crc_matches(tmp_path, threads):
    spawn_ranks(_copy_worker, args=(free_port(), str(tmp_path), threads), nprocs=2)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert [s[:3] for s in seen] == [
        [3, "refused", []],
        [4, "committed", [tier_name(4, 1)]],
        [5, "committed", [tier_name(5, 1)]],
        [6, "committed", [tier_name(6, 1)]],
    ], "a damaged copy commits nothing; a newer copy drops the older one"
    inodes = {step: inode for step, _, _, inode in seen}
    assert inodes[6] == inodes[4] != inodes[5], "copy 6 was written over the files of copy 4, dropped by 5"
    copy = torch.load(tmp_path / "replica-00000/step-6/w.pt", weights_only=True)
    assert torch.equal(copy["w"], torch.arange(3_000_000.0) + 6)
    assert not [p for p in (tmp_path / "replica-00000").rglob("*") if ".air-tmp" in p.name], "no temp left"
    found = holdings(str(tmp_path), "n")
    assert {(h.saved_rank, h.step, h.kind) for h in found} == {(0, 6, "replica")}


def _read_bytes_so_far() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


PART = 1 << 20
"""Floats in a part of the recovery tests (4 MiB): a load that read it again would show."""
SHARDED = ["__0_0.distcp", "__1_0.distcp", "__1_1.distcp"]
"""The data files of the two-rank FSDP2 job: each rank's shards, and the whole items DCP gave rank 1
(of a one-rank job: the first alone)."""
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _recover_worker(rank: int, port: int, folder: str, nodes: str) -> None:
    """Rank ``rank`` on node ``nodes[rank]`` (a folder of ``folder``): recover, then load its part."""
    world = len(nodes)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    node = nodes[rank]
    blames: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = blames.append  # type: ignore[method-assign]
    logging.getLogger("air_core.tiers.recover").addHandler(handler)
    base = os.path.join(folder, node)
    resumed = recover(base, rank=rank, world_size=world, newer_than=None, group=side_group(60), node=node)
    assert resumed is not None
    before = _read_bytes_so_far()
    with AsyncCheckpointer(resumed.root, read_only=True) as reader:
        state = reader.load(reader.latest(), rank=rank)  # memory-mapped: its tensors read no bytes
    read = _read_bytes_so_far() - before
    finders = sorted(r.args[-1] for r in blames)  # type: ignore[index]  # "... check on rank <finder>"
    with open(os.path.join(folder, f"resumed-{rank}.json"), "w") as f:
        json.dump({"step": resumed.step, "w": state["w"][:2].tolist(), "found_by": finders, "read": read}, f)
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("nodes", "found_by"),
    [("AB", [0, 1]), ("NN", [1]), ("ABB", [0, 1])],
    # one node: the part is read once, by the rank that loads it; ABB: rank 2 links the parts rank 1
    # received (and finds nothing itself)
    ids=["two-nodes", "one-node", "two-nodes-three-ranks"],
)
def test_a_damaged_part_is_dropped_and_every_rank_agrees_on_the_older_complete_step(
    tmp_path, nodes, found_by
):
    for rank, node in enumerate(nodes):  # each rank's own local saves of steps 2 and 4, on its node
        with AsyncCheckpointer(str(tmp_path / node / f"rank-{rank:05d}")) as ckpt:
            for step in (2, 4):
                state = {"w": torch.full((PART,), float(10 * rank + step))}
                name = tier_name(step, len(nodes))
                ckpt.save_files({f"step-{step}/rank-{rank}.pt": state}, step=step, name=name)
    damaged = tmp_path / nodes[1] / "rank-00001/step-4/rank-1.pt"  # its own save of step 4: one byte off
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    spawn_ranks(_recover_worker, args=(free_port(), str(tmp_path), nodes), nprocs=len(nodes))
    for rank in range(len(nodes)):
        resumed = json.loads((tmp_path / f"resumed-{rank}.json").read_text())
        assert resumed["step"] == 2 and resumed["w"] == [10.0 * rank + 2] * 2, "step 2 on both, loaded whole"
        # Two nodes: the holder checks its own copy and the receiver what arrived; one node: only its owner.
        assert resumed["found_by"] == found_by, "the ranks that read the damaged part"
        assert resumed["read"] < PART, "the load read its part again after the recovery had checked it"
    assert {(h.saved_rank, h.step) for h in holdings(str(tmp_path / nodes[1]), "x") if h.saved_rank == 1} == {
        (1, 2)
    }, "the damaged part is no longer offered"


def test_a_replaced_node_receives_each_part_once_and_no_load_reads_its_part_again(tmp_path):
    """Node B (ranks 1 and 2) replaced its lost disk: node A holds every part of step 2 (its own, and the
    copies of B's). B's first rank receives each part once, checked as it arrives; rank 2 links them from
    there; and neither load reads its part again for its CRC-32."""
    for saved, root in ((0, "A/rank-00000"), (1, "A/replica-00001"), (2, "A/replica-00002")):
        with AsyncCheckpointer(str(tmp_path / root)) as ckpt:
            state = {"w": torch.full((PART,), float(saved))}
            ckpt.save_files({f"step-2/rank-{saved}.pt": state}, step=2, name=tier_name(2, 3))
    (tmp_path / "B").mkdir()
    spawn_ranks(_recover_worker, args=(free_port(), str(tmp_path), "ABB"), nprocs=3)
    for rank in (0, 1, 2):
        loaded = json.loads((tmp_path / f"resumed-{rank}.json").read_text())
        assert loaded["step"] == 2 and loaded["w"] == [float(rank)] * 2 and loaded["found_by"] == []
        assert loaded["read"] < PART, f"rank {rank}'s load read its part again (checked at recovery)"
    for saved in (0, 1, 2):
        received, linked = (tmp_path / f"B/restore-0000{r}/step-2/rank-{saved}.pt" for r in (1, 2))
        assert received.stat().st_ino == linked.stat().st_ino, "node B received each part once"


def _sharded_worker(rank: int, port: int, folder: str, nodes: str, steps: tuple[int, ...]) -> None:
    """Rank ``rank`` of an FSDP2 job of ``len(nodes)`` ranks, rank r on node nodes[r]. Saving (``steps``): a
    training step before each save into node A (rank 0's part as its own, rank 1's as A's copy of it),
    the full state to ``reference-<step>.pt``. Loading (no ``steps``): recover, load into a fresh model,
    the full state to ``loaded.pt``, and which files of the folder this rank's restore ended up with."""
    world = len(nodes)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    node = nodes[rank]
    model, opt = build()

    def write(out: str) -> None:
        full_model, full_optim = get_state_dict(model, opt, options=FULL)
        if rank == 0:
            torch.save({"model": full_model, "optim": full_optim}, os.path.join(folder, out))

    for step in steps:
        train_step(model, opt, step)
        model_sd, optim_sd = get_state_dict(model, opt)
        root = os.path.join(folder, "A", "rank-00000" if rank == 0 else "replica-00001")
        with AsyncCheckpointer(root) as ckpt:
            state = {f"step-{step}/s": {"model": model_sd, "optim": optim_sd}}
            air_dcp.save(ckpt, state, step=step, name=tier_name(step, world), rank=rank).result(timeout=60)
        write(f"reference-{step}.pt")
    if not steps:
        base = os.path.join(folder, node)
        resumed = recover(base, rank=rank, world_size=world, newer_than=None, group=side_group(60), node=node)
        assert resumed is not None
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        sharded = f"step-{resumed.step}/s"
        fetched = Fetched()
        with AsyncCheckpointer(resumed.root, read_only=True, listeners=[fetched]) as reader:
            reader.bring = resumed.bring
            air_dcp.load(reader, state, reader.latest(), folder=sharded)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        here = os.path.join(resumed.root, sharded)
        files = {name: os.stat(os.path.join(here, name)) for name in os.listdir(here)}
        with open(os.path.join(folder, f"files-{rank}.json"), "w") as f:
            json.dump(
                {
                    "inodes": {name: st.st_ino for name, st in files.items()},
                    "sizes": {name: st.st_size for name, st in files.items()},
                    "restored": fetched.bytes,
                },
                f,
            )
        write("loaded.pt")
    dist.destroy_process_group()
    exit_without_teardown()  # an FSDP2 job's teardown can abort after its work succeeded (gloo_exit.py)


SAME_WORLD_B = [".metadata", ".metadata-part-0", ".metadata-part-1", "__1_0.distcp", "__1_1.distcp"]
"""What node B's rank ends up with at the same world size: its own shards and rank 1's whole items."""


@pytest.mark.parametrize(
    ("saved", "loading", "steps", "on_b"),
    [
        ("AB", "AB", (2,), SAME_WORLD_B),
        ("A", "ABB", (2,), [".metadata", ".metadata-part-0", "__0_0.distcp"]),
        ("AB", "AB", (2, 4), SAME_WORLD_B),  # A's copy of rank 1's step 4 shards is damaged: step 2
    ],
    ids=["same-world", "grown-from-one-to-three", "a-shard-left-on-A-damaged"],
)
def test_a_replaced_node_gets_the_shards_its_load_reads_and_no_others(tmp_path, saved, loading, steps, on_b):
    """Node B replaced its lost disk; node A holds the steps saved (its own part, and its copy of B's). B
    is sent each part without its DCP data files, and its loads bring the ones their plans read: at the
    same world size rank 1's shards and whole items, never rank 0's shards; grown from a job of one rank,
    rank 0's one file, which holds a slice of every tensor each of B's two ranks loads, received once
    for both. A shard left on A is checked there at the recovery, so a damaged one moves every rank to
    the older step."""
    spawn_ranks(_sharded_worker, args=(free_port(), str(tmp_path), saved, steps), nprocs=len(saved))
    if len(steps) > 1:
        shard = tmp_path / f"A/replica-00001/step-{steps[-1]}/s/__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    (tmp_path / "B").mkdir()
    spawn_ranks(_sharded_worker, args=(free_port(), str(tmp_path), loading, ()), nprocs=len(loading))
    reference = torch.load(tmp_path / f"reference-{steps[0]}.pt", weights_only=False)
    assert_same_state(reference, torch.load(tmp_path / "loaded.pt", weights_only=False))
    ended = [json.loads((tmp_path / f"files-{rank}.json").read_text()) for rank in range(len(loading))]
    files = [e["inodes"] for e in ended]
    shares = [f".metadata-part-{r}" for r in range(len(saved))]
    assert sorted(files[0]) == [".metadata", *shares, *SHARDED[: 3 * len(saved) - 2]], "linked on A, all"
    for rank in range(1, len(loading)):
        assert sorted(files[rank]) == on_b, f"brought to B's rank {rank}: what it reads"
        read = sum(size for name, size in ended[rank]["sizes"].items() if not name.startswith(".metadata-"))
        assert ended[rank]["restored"] == read, "the restore counts the bytes brought, like those fetched"
    if len(loading) > 2:
        assert files[1]["__0_0.distcp"] == files[2]["__0_0.distcp"], "received once for node B"


def test_a_shard_file_the_ranks_of_one_folder_read_is_received_once_for_them_spread_by_file():
    """Ranks 1 and 2 share node B's folder, rank 3 is on node C; rank 0 (node A) keeps part 0."""
    b, c = ("B", "/local"), ("C", "/local")
    both = [(0, "s/__0_0.distcp"), (0, "s/__0_1.distcp")]
    asks = [(("A", "/local"), []), (b, both), (b, both), (c, [(0, "s/__0_0.distcp")])]
    receiver, pending = _bring_plan(asks, {0: 0})
    assert receiver == {(b, "s/__0_0.distcp"): 1, (b, "s/__0_1.distcp"): 2, (c, "s/__0_0.distcp"): 3}
    assert [sorted(r.items()) for r in _rounds(pending)] == [
        [((0, (0, ("s/__0_0.distcp",))), [1, 3])],
        [((0, (0, ("s/__0_1.distcp",))), [2])],
    ], "one send of a file to each folder reading it; B's two files to its two ranks"


def test_a_node_lacking_a_part_receives_it_once_unless_its_ranks_see_different_parts():
    nodes = ["A", "B", "B", "C", "C"]  # rank 3 holds part 1 and rank 4 does not: they use two folders
    via = _receivers(nodes, {0: {0}, 1: {1, 2, 3}})
    assert via[0] == {1: 1, 2: 1, 3: 3, 4: 4}, "B's ranks share a folder: rank 1 receives for rank 2"
    assert via[1] == {0: 0, 4: 4}, "on C each rank receives for itself: none waits on one that waits"


def test_a_replaced_node_s_parts_come_from_every_rank_of_the_holder_to_every_rank_of_it_in_rounds():
    """Nodes A (ranks 0, 1: their own parts and the copies of B's) and B (ranks 2, 3, replaced)."""
    kinds = {0: "local", 1: "local", 2: "replica", 3: "replica"}
    holders = {s: [(r, held(s, 2, 4, kind)) for r in (0, 1)] for s, kind in kinds.items()}
    plan = _plan(["A", "A", "B", "B"], holders)
    assert plan.via == {
        0: {2: 2, 3: 2},
        1: {2: 3, 3: 3},
        2: {2: 2, 3: 2},
        3: {2: 3, 3: 3},
    }, "each part once for node B: its own parts to their ranks, A's spread over B's ranks"
    assert plan.senders == {0: 0, 1: 1, 2: 0, 3: 1}, "A's ranks share the sending"
    assert [sorted(r.items()) for r in plan.rounds] == [
        [((0, 0), [2]), ((1, 1), [3])],
        [((0, 2), [2]), ((1, 3), [3])],
    ], "two pairs at a time, in two rounds, instead of four transfers one after another"


def test_a_remembered_check_serves_the_next_check_of_the_unchanged_file_once(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 4096)
    entry = FileEntry("f.bin", 4096, zlib.crc32(b"x" * 4096), 0)
    assert matches(str(path), entry, remember=True)
    st = os.stat(path)
    with open(path, "r+b") as f:  # damaged in place, its modification time put back: bit rot
        f.write(b"y")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert matches(str(path), entry), "the check right after is served from the remembered one"
    assert not matches(str(path), entry), "any later check reads the file again"


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"local_every_n_steps": 5}, "local_dir"),
        ({"local_every_n_steps": -1, "local_dir": "/tmp/x"}, "local_every_n_steps"),
        ({"local_every_n_steps": 5, "local_dir": "s3://bucket/x"}, "local_dir"),
        ({"replication_factor": 0}, "replication_factor"),
    ],
)
def test_bad_tier_settings_fail_when_built_naming_the_setting(settings, named):
    with pytest.raises(ConfigError, match=named):
        SessionConfig(**settings)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any folder")
def test_a_local_dir_this_process_may_not_write_fails_when_built(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=rf"local_dir=.*may not write to {locked}"):
        SessionConfig(local_every_n_steps=5, local_dir=str(locked / "air"))


def test_local_every_n_steps_0_is_off_as_every_n_train_steps_0_is(tmp_path, caplog):
    """Lightning's ``every_n_train_steps=0`` means off; a YAML config written that way must not fail (nor
    start a tier)."""
    assert SessionConfig(local_every_n_steps=0).local_every_n_steps is None
    with caplog.at_level(logging.WARNING, logger="air_core.session.config"):
        config = SessionConfig(local_every_n_steps=0, local_dir=str(tmp_path / "local"))
    assert config.local_every_n_steps is None and config.local_dir is None
    assert any("local_every_n_steps is off" in r.getMessage() for r in caplog.records), "unused local_dir"
    with pytest.raises(ConfigError, match=r"local_every_n_steps=-1\): must be a number of steps >= 1, or 0"):
        SessionConfig(local_every_n_steps=-1, local_dir=str(tmp_path / "local"))


def test_a_local_dir_without_local_every_n_steps_warns_once_when_built(tmp_path, caplog):
    """Not an error (a YAML config may keep local_dir with the tier off), but never silent."""
    with caplog.at_level(logging.WARNING, logger="air_core.session.config"):
        config = SessionConfig(local_dir=str(tmp_path / "local"), owner="AirCallback")
        dataclasses.replace(config, log_every_n_steps=7)  # as the session's ``log_every`` does
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, f"one warning, when built: {warnings}"
    assert warnings[0].startswith("AirCallback(local_dir="), warnings[0]
    assert "local_every_n_steps is off, so no local tier runs" in warnings[0], warnings[0]
    assert config.local_dir is None, "held as off"
    assert not (tmp_path / "local").exists(), "no folder made for a tier that is off"
