"""Sharded checkpoints through ``air_core.dcp``: an FSDP2 model + AdamW saved by 2 gloo processes loads
at world size 1, 2 and 4 with every tensor equal to the full reference; a rank killed while writing
leaves the previous checkpoint the newest; a damaged shard is skipped; a stock DCP reader reads the
committed folder. The adapters' shared layer (``model_state``, ``optimizer_state``, ``ShardedState``,
``load_into``) refers to the live shards, lays out Lightning's and Accelerate's folders, and loads either
into a fresh FSDP2 model and optimizer at world size 1 and 2."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from air_core import AsyncCheckpointer
from air_core import dcp as air_dcp
from air_core.errors import ConfigError
from tests.conftest import REPO
from tests.sameness import assert_same_state
from tests.zygote import python


def _run(
    world: int, root: str, mode: str, arg: int | None = None, *, worker: list[str] | None = None
) -> list[subprocess.CompletedProcess]:
    """Run ``world`` worker processes (default ``tests/sharded_worker.py``) over one gloo group."""
    init = os.path.join(os.path.dirname(root), f"init-{mode}-{world}-{os.urandom(4).hex()}")
    env = {**os.environ, "PYTHONPATH": REPO}
    extra = [] if arg is None else [str(arg)]
    worker = worker or [os.path.join(REPO, "tests/sharded_worker.py")]
    procs = [
        subprocess.Popen(
            [python(), *worker, str(r), str(world), root, init, mode, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    outs = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:  # the workers enable faulthandler: SIGABRT prints each thread's stack
                if q.poll() is None:
                    q.send_signal(signal.SIGABRT)
            out, err = p.communicate(timeout=30)
            pytest.fail(f"rank {rank} of {mode} hung for 180 s; its output:\n{out}\n{err[-8000:]}")
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs


def _ok(outs: list[subprocess.CompletedProcess]) -> None:
    for out in outs:
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """Two FSDP2 checkpoints (steps 1 and 2) saved by 2 processes; the path of the root."""
    root = str(tmp_path_factory.mktemp("dcp") / "root")
    outs = _run(2, root, "save")
    _ok(outs)
    for rank, out in enumerate(outs):  # what the tests below load is a save whose plan was replayed
        assert f"rank {rank} committed step 1 (planned)" in out.stdout
        assert f"rank {rank} committed step 2 (replayed)" in out.stdout
    return root


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp2_checkpoint_of_two_ranks_loads_at_any_world_size(saved, world, tmp_path):
    root = str(tmp_path / "root")
    shutil.copytree(saved, root)
    _ok(_run(world, root, "load"))
    loaded = torch.load(tmp_path / f"loaded-{world}.pt", weights_only=False)
    reference = torch.load(os.path.join(os.path.dirname(saved), "reference-2.pt"), weights_only=False)
    assert (loaded["name"], loaded["step"]) == ("step-000000002", 2)
    assert_same_state(reference, {"model": loaded["model"], "optim": loaded["optim"]})


@pytest.mark.slow
def test_a_committed_sharded_checkpoint_is_a_stock_dcp_checkpoint(saved):
    reader = AsyncCheckpointer(saved, read_only=True)
    info = reader.latest()
    assert info is not None and air_dcp.dcp_folders(info) == [info.name]
    names = sorted(os.path.basename(f.path) for f in info.manifest.files)
    # few files: one per rank, and the whole tensors and objects DCP gave rank 1 in one of their own
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__1_1.distcp"]
    reference = torch.load(os.path.join(os.path.dirname(saved), "reference-2.pt"), weights_only=False)
    # The full (unsharded) model, read by DCP's own FileSystemReader in one process from the folder.
    state = {"model": {k: torch.zeros_like(v) for k, v in reference["model"].items()}, "step": -1}
    dcp.load(state, storage_reader=FileSystemReader(os.path.join(saved, info.name)), no_dist=True)
    assert state["step"] == 2
    assert_same_state(reference["model"], state["model"])


@pytest.mark.slow
def test_at_the_same_world_size_a_rank_fetches_its_own_shards_and_the_whole_items_not_other_shards(
    saved, tmp_path
):
    root = str(tmp_path / "root")
    shutil.copytree(saved, root)
    outs = _run(2, root, "load")
    _ok(outs)
    info = AsyncCheckpointer(root, read_only=True).latest()
    assert info is not None and info.manifest is not None
    sizes = {os.path.basename(f.path): f.size for f in info.manifest.files}
    with open(os.path.join(root, info.name, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    files: dict[bool, set[str]] = {True: set(), False: set()}  # holding whole items; holding shards
    for index, stored in metadata.storage_data.items():
        kept = metadata.state_dict_metadata[index.fqn]
        files[not isinstance(kept, TensorStorageMetadata) or len(kept.chunks) == 1].add(stored.relative_path)
    whole = files[True]
    assert whole and whole.isdisjoint(files[False])  # replicated items are never in a file of shards
    for rank, out in enumerate(outs):
        needed = {".metadata", *whole, *(name for name in sizes if name.startswith(f"__{rank}_"))}
        fetched = int(re.search(r"fetched (\d+) bytes", out.stdout).group(1))
        assert fetched == sum(sizes[name] for name in needed), (rank, needed, sizes)


@pytest.mark.slow
def test_a_damaged_shard_is_skipped_for_the_previous_checkpoint(saved, tmp_path):
    root = str(tmp_path / "root")
    shutil.copytree(saved, root)
    shard = os.path.join(root, "step-000000002", "__1_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    open(shard, "wb").write(bytes(data))
    outs = _run(2, root, "load")
    _ok(outs)
    assert "skipping checkpoint step-000000002" in outs[0].stderr + outs[1].stderr
    loaded = torch.load(tmp_path / "loaded-2.pt", weights_only=False)
    reference = torch.load(os.path.join(os.path.dirname(saved), "reference-1.pt"), weights_only=False)
    assert (loaded["name"], loaded["step"]) == ("step-000000001", 1)
    assert_same_state(reference, {"model": loaded["model"], "optim": loaded["optim"]})


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])  # the coordinator (writes .metadata) or another rank
def test_a_rank_killed_while_writing_leaves_the_previous_checkpoint_newest(tmp_path, victim):
    root = str(tmp_path / "root")
    outs = _run(2, root, "die", victim)
    assert outs[victim].returncode == -9
    survivor = outs[1 - victim]
    assert "committed step 1" in survivor.stdout
    assert "committed step 2" not in survivor.stdout
    reader = AsyncCheckpointer(root, read_only=True)
    statuses = {i.name: i.status for i in reader.list()}
    assert statuses == {"step-000000001": "committed", "step-000000002": "partial"}
    if victim == 0:  # a relaunch resumes from step 1 (the partial is never read)
        _ok(_run(2, root, "load"))
        loaded = torch.load(tmp_path / "loaded-2.pt", weights_only=False)
        assert loaded["name"] == "step-000000001"


def test_writer_settings_fail_at_construction(tmp_path):
    with AsyncCheckpointer(str(tmp_path / "root")) as ckpt:
        with pytest.raises(ConfigError, match="files_per_rank"):
            air_dcp.DcpWriter(ckpt, folder="x", files_per_rank=0)
        with pytest.raises(ConfigError, match="folder"):
            air_dcp.DcpWriter(ckpt, folder="../elsewhere")
        with pytest.raises(ConfigError, match="no folder"):
            air_dcp.save(ckpt, {}, step=1)


def test_one_process_save_splits_into_files_and_loads_back(tmp_path):
    """Without a process group (DCP's single-process mode), through a staged remote-like root."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    state = {"model": model.state_dict(), "meta": {"epoch": 3, "note": "x"}}
    with AsyncCheckpointer(str(tmp_path / "root"), staging_dir=str(tmp_path / "staging")) as ckpt:
        air_dcp.save(
            ckpt,
            {"step-000000007": state},
            step=7,
            files_per_rank=2,
            files={"step-000000007/extra.pt": {"a": 1}},
        ).result()
        info = ckpt.latest()
        assert info is not None
        assert sorted(f.path for f in info.manifest.files) == [
            "step-000000007/.metadata",
            "step-000000007/__0_0.distcp",
            "step-000000007/__0_1.distcp",
            "step-000000007/extra.pt",
        ]
        fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "meta": {"epoch": 0}}
        air_dcp.load(ckpt, fresh, info)
        assert_same_state(state["model"], fresh["model"])
        assert fresh["meta"]["epoch"] == 3


@pytest.mark.parametrize("planning", ["every save", "dcp plan caching", "air SavePlans"])
def test_saves_whose_plan_repeats_or_changes_each_load_their_own_values(tmp_path, planning):
    """With DCP's plan caching or our ``SavePlans`` an unchanged plan reuses the last global plan and
    metadata object, and a changed one (a key added, then gone) is planned again; every commit must
    still hold its own values and its own ``.metadata``."""
    torch.manual_seed(0)
    shapes = [{"a": (4, 3), "b": (5,)}, {"a": (4, 3), "b": (5,)}, {"a": (4, 3), "b": (5,), "c": (2,)}]
    shapes += [shapes[0], {"a": (4, 3), "b": (6,)}, {"a": (4, 3), "b": (6,)}]
    saved = []
    plans = air_dcp.SavePlans() if planning == "air SavePlans" else None
    with AsyncCheckpointer(str(tmp_path / "root"), keep_last=10) as ckpt:
        for step, keys in enumerate(shapes, start=1):
            state = {"w": {k: torch.randn(*s) for k, s in keys.items()}, "step": step}
            saved.append(state)
            planner = DefaultSavePlanner(enable_plan_caching=True) if planning == "dcp plan caching" else None
            air_dcp.save(ckpt, {f"step-{step}": state}, step=step, planner=planner, plans=plans).result()
        infos = [i for i in ckpt.list() if i.status == "committed"]
        assert [i.step for i in infos] == [1, 2, 3, 4, 5, 6]
        if plans is not None:  # steps 2 and 6 repeat the plan before them; a shape change does not
            assert plans.replayed == 2
        for info, state in zip(infos, saved, strict=True):
            fresh = {"w": {k: torch.zeros_like(v) for k, v in state["w"].items()}, "step": 0}
            air_dcp.load(ckpt, fresh, info)
            assert_same_state(state["w"], fresh["w"])
            assert fresh["step"] == state["step"], f"step {info.step}: its own non-tensor value"


def test_a_repeated_plan_bundled_into_other_files_is_planned_again(tmp_path):
    """The write results name the files: a save of the same items into more files must not reuse them."""
    plans = air_dcp.SavePlans()
    with AsyncCheckpointer(str(tmp_path / "root"), keep_last=10) as ckpt:
        states = [{"w": {"a": torch.randn(4, 3), "b": torch.randn(5)}} for _ in range(2)]
        for step, (state, files) in enumerate(zip(states, (1, 2), strict=True), start=1):
            air_dcp.save(ckpt, {f"step-{step}": state}, step=step, files_per_rank=files, plans=plans).result()
        assert plans.replayed == 0
        info = ckpt.latest()
        assert len([f for f in info.manifest.files if f.path.endswith(".distcp")]) == 2
        fresh = {"w": {k: torch.zeros_like(v) for k, v in states[1]["w"].items()}}
        air_dcp.load(ckpt, fresh, info)
        assert_same_state(states[1]["w"], fresh["w"])


def test_a_save_of_several_folders_replays_each_folders_plan(tmp_path):
    """Accelerate's FSDP2 saves are one commit of several DCP folders (model, optimizer): each folder's
    plan is kept by its position, and a repeated save loads back its own values in every folder."""
    plans = air_dcp.SavePlans()
    with AsyncCheckpointer(str(tmp_path / "root"), keep_last=10) as ckpt:
        saved = []
        for step in (1, 2):
            folders = {
                f"ckpt-{step}/model": {"model": {"w": torch.randn(6, 4), "b": torch.randn(4)}},
                f"ckpt-{step}/optimizer": {"optimizer": {"m": torch.randn(3), "lr": 0.1 * step}},
            }
            air_dcp.save(ckpt, folders, step=step, name=f"ckpt-{step}", plans=plans).result()
            saved.append(folders)
        assert plans.replayed == 2  # both folders of the second save
        info = ckpt.latest()
        assert air_dcp.dcp_folders(info) == ["ckpt-2/model", "ckpt-2/optimizer"]
        for folder, state in saved[1].items():
            (key,) = state
            fresh = {
                key: {
                    k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
                    for k, v in state[key].items()
                }
            }
            air_dcp.load(ckpt, fresh, info, folder=folder)
            for k, v in state[key].items():
                assert torch.equal(fresh[key][k], v) if isinstance(v, torch.Tensor) else fresh[key][k] == v


# -- model_state / optimizer_state / ShardedState / load_into: what both adapters' sharded saves use ----

_API_WORKER = """
import os, sys, uuid
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from air_core import AsyncCheckpointer
from air_core import dcp as air_dcp
from tests.gloo_exit import exit_without_teardown

rank, world, root, init, mode = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6]
out = os.path.dirname(root)
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def build(seed):  # a fresh model (seed 1) has other weights and another lr, both set by a load
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1 if seed == 0 else 0.5)


def step(model, opt):
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    opt.step()
    opt.zero_grad()


def full(model, opt, name):
    model_sd, optim_sd = get_state_dict(model, opt, options=FULL)  # every rank: a collective
    if rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, os.path.join(out, name))


launch = [uuid.uuid4().hex if rank == 0 else None]
dist.broadcast_object_list(launch, src=0)
ckpt = AsyncCheckpointer(root, rank=rank, world_size=world, launch_id=launch[0])
model, opt = build(0)
step(model, opt)
if mode == "live":
    assert not air_dcp.SHARDED_OPTIONS.full_state_dict and not air_dcp.SHARDED_OPTIONS.cpu_offload
    params = dict(model.named_parameters())
    model_sd, optim_sd = air_dcp.model_state(model), air_dcp.optimizer_state(model, opt)
    assert model_sd.keys() == params.keys(), model_sd.keys()
    assert optim_sd["state"].keys() == params.keys(), optim_sd["state"].keys()
    with torch.no_grad():
        for key, param in params.items():
            moments = [optim_sd["state"][key][m] for m in ("exp_avg", "exp_avg_sq")]
            assert all(isinstance(v, DTensor) for v in [model_sd[key], *moments]), key
            for value in (param, *opt.state[param].values()):
                if isinstance(value, DTensor):
                    value.to_local().add_(1.0)  # the live shard changes: the state dict sees it (no copy)
            assert torch.equal(model_sd[key].to_local(), param.to_local()), key
            for m, moment in zip(("exp_avg", "exp_avg_sq"), moments):
                assert torch.equal(moment.to_local(), opt.state[param][m].to_local()), (key, m)
    print(f"rank {rank} live", flush=True)
elif mode == "save":
    folders = {  # one commit: Lightning's folder, then Accelerate's model and optimizer folders
        "ckpt/lightning": air_dcp.ShardedState(model, "state_dict", {"optimizer_0": opt}).state_dict(),
        "ckpt/model": air_dcp.ShardedState(model).state_dict(),
        "ckpt/optimizer": air_dcp.ShardedState(model, None, {"optimizer": opt}).state_dict(),
    }
    air_dcp.save(ckpt, folders, step=1, name="ckpt").result(timeout=60)
    full(model, opt, "reference.pt")
    full(*build(1), "fresh.pt")
else:  # load: into fresh models and optimizers at this world size
    info = ckpt.latest()
    lightning_model, lightning_opt = build(1)
    target = air_dcp.ShardedState(lightning_model, "state_dict", {"optimizer_0": lightning_opt})
    air_dcp.load_into(ckpt, info, target, folder="ckpt/lightning")
    full(lightning_model, lightning_opt, f"lightning-{world}.pt")
    accelerate_model, accelerate_opt = build(1)
    air_dcp.load_into(ckpt, info, air_dcp.ShardedState(accelerate_model), folder="ckpt/model")
    only_optimizer = air_dcp.ShardedState(accelerate_model, None, {"optimizer": accelerate_opt})
    air_dcp.load_into(ckpt, info, only_optimizer, folder="ckpt/optimizer")
    full(accelerate_model, accelerate_opt, f"accelerate-{world}.pt")
    # strict: a loaded state lacking a key is refused, unless strict=False (the rest is set)
    partial_model, partial_opt = build(1)
    lenient = air_dcp.ShardedState(partial_model, strict=False)
    state = lenient.state_dict()
    del state["model"]["0.bias"]  # before the load: DCP loads into the live shards in place
    air_dcp.load(ckpt, state, info, folder="ckpt/model")
    try:
        air_dcp.ShardedState(partial_model).load_state_dict(state)
    except RuntimeError as exc:
        assert "0.bias" in str(exc), exc
    else:
        raise AssertionError("strict=True set a state lacking 0.bias")
    lenient.load_state_dict(state)
    full(partial_model, partial_opt, f"partial-{world}.pt")
    print(f"rank {rank} loaded", flush=True)
ckpt.close()
dist.destroy_process_group()
exit_without_teardown()
"""


def _run_api(world: int, root: str, mode: str) -> None:
    outs = _run(world, root, mode, worker=["-c", _API_WORKER])
    _ok(outs)


@pytest.fixture(scope="module")
def saved_layouts(tmp_path_factory) -> str:
    """One commit of 2 FSDP2 processes holding Lightning's folder and Accelerate's two; the root."""
    root = str(tmp_path_factory.mktemp("dcp-api") / "root")
    _run_api(2, root, "save")
    return root


@pytest.mark.slow
def test_model_and_optimizer_state_are_the_live_shards_not_copies(tmp_path):
    """``model_state``/``optimizer_state``: DTensors over the very shards training updates (a change to
    a parameter's or a moment's local shard is seen through the state dict): the snapshot is the one copy."""
    _run_api(2, str(tmp_path / "root"), "live")


@pytest.mark.slow
def test_sharded_state_saves_each_frameworks_keys(saved_layouts):
    """``ShardedState.state_dict`` lays each folder out as its framework does, so stock loaders find it."""
    info = AsyncCheckpointer(saved_layouts, read_only=True).latest()
    assert info is not None
    assert air_dcp.dcp_folders(info) == ["ckpt/lightning", "ckpt/model", "ckpt/optimizer"]
    tops = {
        folder: {
            k.split(".")[0]
            for k in FileSystemReader(os.path.join(saved_layouts, folder)).read_metadata().state_dict_metadata
        }
        for folder in air_dcp.dcp_folders(info)
    }
    assert tops == {
        "ckpt/lightning": {"state_dict", "optimizer_0"},
        "ckpt/model": {"model"},
        "ckpt/optimizer": {"optimizer"},
    }
    reference = torch.load(os.path.join(os.path.dirname(saved_layouts), "reference.pt"), weights_only=False)
    state = {"model": {k: torch.zeros_like(v) for k, v in reference["model"].items()}}
    reader = FileSystemReader(os.path.join(saved_layouts, "ckpt/model"))
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert_same_state(reference["model"], state["model"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_load_into_sets_model_and_optimizer_of_either_layout_at_any_world_size(
    saved_layouts, world, tmp_path
):
    """``load_into`` a fresh model and optimizer (other values), Lightning's one folder or Accelerate's
    two, at world size 1 and 2: every tensor equals the saved one; ``strict=False`` sets what is there."""
    root = str(tmp_path / "root")
    shutil.copytree(saved_layouts, root)
    _run_api(world, root, "load")
    reference = torch.load(os.path.join(os.path.dirname(saved_layouts), "reference.pt"), weights_only=False)
    for layout in ("lightning", "accelerate"):
        loaded = torch.load(tmp_path / f"{layout}-{world}.pt", weights_only=False)
        assert_same_state(reference, loaded, f"({layout}'s layout at world size {world})")
    fresh = torch.load(os.path.join(os.path.dirname(saved_layouts), "fresh.pt"), weights_only=False)
    partial = torch.load(tmp_path / f"partial-{world}.pt", weights_only=False)["model"]
    assert not torch.equal(fresh["model"]["0.bias"], reference["model"]["0.bias"])
    assert torch.equal(partial["0.bias"], fresh["model"]["0.bias"])  # left as it was
    assert_same_state(
        {k: v for k, v in reference["model"].items() if k != "0.bias"},
        {k: v for k, v in partial.items() if k != "0.bias"},
    )


def test_a_sharded_state_that_holds_nothing_or_a_key_twice_is_refused():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="nothing"):
        air_dcp.ShardedState(model, None)
    with pytest.raises(ConfigError, match="also names an optimizer"):
        air_dcp.ShardedState(model, "model", {"model": opt})
