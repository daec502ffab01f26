"""The snapshot isolates the saved state, reuses its buffers and respects the host budget."""

from __future__ import annotations

import collections
import os
import subprocess

import pytest
import torch

from air_core import AsyncCheckpointer, ConfigError
from air_core.session import SessionConfig, TrainingSession
from air_core.snapshot import HostBuffer, materialize, take_snapshot
from tests.conftest import REPO
from tests.zygote import python


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)},
        "opt": {"state": {0: {"exp_avg": torch.randn(256, 64, generator=g), "step": torch.tensor(7.0)}}},
        "meta": {"epoch": 3, "names": ["a", "b"], "od": collections.OrderedDict(x=1)},
    }


def test_gated_tensors_land_after_save_returns_and_hold_their_values_at_save_time(tmp_path, slow_copies):
    """``gated`` tensors (what only the optimizer step after the gate mutates) are copied on a thread: the
    caller may run on, mutating anything else at once; after ``wait_snapshot`` the gated ones too."""
    state = _state()
    expected = {k: v.clone() for k, v in state["model"].items()}
    with AsyncCheckpointer(str(tmp_path)) as ckpt:
        handle = ckpt.save(state, step=1, gated=[state["model"]["w"], state["opt"]["state"][0]["exp_avg"]])
        state["model"]["b"].zero_()  # not gated: copied before save() returned
        handle.wait_snapshot()  # the gate
        state["model"]["w"].add_(100.0)
        state["opt"]["state"][0]["exp_avg"].zero_()
        handle.result(timeout=60)
        loaded = ckpt.load()
    assert len(slow_copies) == 1, "the gated tensors are copied on the copy thread"
    assert torch.equal(loaded["model"]["w"], expected["w"])
    assert torch.equal(loaded["model"]["b"], expected["b"])
    assert torch.equal(loaded["opt"]["state"][0]["exp_avg"], _state()["opt"]["state"][0]["exp_avg"])


def test_a_gated_copy_that_fails_fails_its_save_not_the_gate(tmp_path, monkeypatch):
    from air_core import SaveError
    from air_core.snapshot import Copies

    def broken(self: Copies, copy) -> None:
        self.error = RuntimeError("copy failed")  # as the thread records a copy that raised

    monkeypatch.setattr(Copies, "on_thread", broken)
    state = _state()
    with AsyncCheckpointer(str(tmp_path)) as ckpt:
        handle = ckpt.save(state, step=1, gated=[state["model"]["w"]])
        handle.wait_snapshot()  # returns: training goes on
        with pytest.raises(SaveError, match="copy failed"):
            handle.result(timeout=60)
        assert ckpt.latest() is None, "nothing was committed"


def test_save_is_isolated_from_inplace_mutation(tmp_path):
    state = _state()
    expected = {k: v.clone() for k, v in state["model"].items()}
    with AsyncCheckpointer(str(tmp_path)) as ckpt:
        handle = ckpt.save(state, step=1)
        state["model"]["w"].add_(100.0)  # mutate right after save() returns
        state["model"]["b"].zero_()
        state["meta"]["names"].append("late")
        handle.result(timeout=60)
        loaded = ckpt.load()
    assert torch.equal(loaded["model"]["w"], expected["w"]), "the saved weights must be those at save() time"
    assert torch.equal(loaded["model"]["b"], expected["b"])
    assert loaded["meta"]["names"] == ["a", "b"], "non-tensor state must be copied at save() time too"


def test_staging_buffer_is_allocated_once_and_reused(tmp_path):
    with AsyncCheckpointer(str(tmp_path), keep_last=1) as ckpt:
        for step in range(5):
            ckpt.save(_state(step), step=step).result(timeout=60)
        assert ckpt.buffer_allocations == 1, "same-size saves must reuse one staging buffer"


def test_aliasing_and_parameters_survive_the_snapshot(tmp_path):
    shared = torch.arange(10.0)
    param = torch.nn.Parameter(torch.ones(3))
    state = {"a": shared, "view": shared[2:5], "again": shared, "p": param}
    buffer = HostBuffer(None, shared=False)
    snap = take_snapshot(state, buffer, spill_dir=str(tmp_path), spill_name="s")
    shared.mul_(-1)
    out = materialize(snap)
    assert torch.equal(out["a"], torch.arange(10.0))
    assert out["view"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr(), (
        "views keep aliasing"
    )
    assert out["again"] is out["a"], "the same tensor twice stays one object"
    assert isinstance(out["p"], torch.nn.Parameter) and out["p"].requires_grad


def test_a_save_holds_the_buffers_the_next_forward_updates(tmp_path):
    """A tracked model's buffers are copied apart from the rest (on a GPU, ahead of the next forward, on
    the training stream): a BatchNorm forward right after ``save`` returns must not reach the checkpoint,
    and no tensor may be left out of the copy, buffers included."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4)).train()
    model(torch.randn(8, 6))
    session = TrainingSession(SessionConfig(mlflow=False))
    session.track_model(model)
    session.track_model(model)  # once is enough
    session.open(str(tmp_path / "root"))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    handle = session.save({"step-1/rank-0.pt": model.state_dict()}, step=1, name="step-1")
    model(torch.randn(8, 6) + 5.0)  # updates running_mean, running_var, num_batches_tracked in place
    session.before_optimizer_step()
    handle.result(timeout=60)
    loaded = session.checkpointer.load()
    session.close(step=1)
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), f"{key}: the value at save() time"
    assert not torch.equal(model.state_dict()["1.running_mean"], saved["1.running_mean"])


def test_host_budget_is_never_exceeded_and_spill_saves_correctly(tmp_path):
    budget = 1 << 20  # 1 MiB for a ~4.3 MiB state
    state = {f"t{i}": torch.randn(256, 1024) for i in range(4)} | {"small": torch.arange(5)}
    records = []

    class Rec:
        def on_event(self, event):
            records.append(event)

    with AsyncCheckpointer(
        str(tmp_path / "dst"),
        staging_dir=str(tmp_path / "stage"),
        host_budget_bytes=budget,
        listeners=[Rec()],
    ) as ckpt:
        ckpt.save(state, step=1).result(timeout=60)
        assert 0 < ckpt.host_bytes_allocated <= budget, "staging buffers must stay within host_budget_bytes"
        loaded = ckpt.load()
    for key, value in state.items():
        assert torch.equal(loaded[key], value), f"{key} must survive the spill bitwise"
    save = next(r for r in records if type(r).__name__ == "SaveRecord")
    assert save.spilled_bytes >= 3 * (1 << 20), "what does not fit the budget must spill to the staging dir"
    leftovers = [p for p in (tmp_path / "stage").rglob("*.spill") if p.is_file()]
    assert not leftovers, "spill files are removed once serialized"


def test_sparse_tensor_is_refused_with_the_fix(tmp_path):
    with AsyncCheckpointer(str(tmp_path)) as ckpt:
        with pytest.raises(ConfigError, match="to_dense"):
            ckpt.save({"s": torch.eye(3).to_sparse()}, step=1)
        ckpt.save({"ok": torch.ones(1)}, step=2).result(timeout=60)  # the buffer was handed back


_DTENSOR_POINTERS = """
import torch, torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
from air_core.snapshot import storage_pointers
dist.init_process_group("gloo", init_method="file://" + __import__("sys").argv[1], rank=0, world_size=1)
plain = torch.zeros(3)
sharded = distribute_tensor(torch.randn(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
found = storage_pointers([plain, sharded])
assert found == {plain.untyped_storage().data_ptr(), sharded.to_local().untyped_storage().data_ptr()}, found
dist.destroy_process_group()
"""


def test_in_order_tensors_may_be_dtensors(tmp_path):
    """A DTensor has no storage of its own (its ``untyped_storage()`` raises): its local shard's storage is
    what a sharded save copies, so that is the one looked up."""
    out = subprocess.run(
        [python(), "-c", _DTENSOR_POINTERS, str(tmp_path / "init")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert out.returncode == 0, out.stderr[-3000:]
