"""The snapshot isolates the saved state, reuses its buffers and respects the host budget."""

from __future__ import annotations

import collections

import pytest
import torch

from air_core import AsyncCheckpointer, ConfigError
from air_core.snapshot import HostBuffer, materialize, take_snapshot


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)},
        "opt": {"state": {0: {"exp_avg": torch.randn(256, 64, generator=g), "step": torch.tensor(7.0)}}},
        "meta": {"epoch": 3, "names": ["a", "b"], "od": collections.OrderedDict(x=1)},
    }


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
