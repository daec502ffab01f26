"""AirAccelerator's FSDP2 save/load code on CPU (Accelerate itself turns FSDP off there): the DTensor state
of a ``fully_shard``-ed model + AdamW saved by 2 gloo processes in Accelerate's folder layout, one
commit, loads at 1 and 3 processes equal to the full reference, and each folder reads with stock DCP.
The real ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))`` run is in
benchmarks/gpu_check.sh."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from air_core import AsyncCheckpointer
from air_core.dcp import dcp_folders
from tests.conftest import REPO
from tests.sameness import assert_same_state

pytestmark = pytest.mark.slow
WORKER = os.path.join(REPO, "tests/accelerate/sharded_worker.py")


def _torchrun(nproc: int, root: str, out: str, mode: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += [WORKER, root, out, mode]  # --standalone: a free port of this host
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": REPO}
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_fsdp2_state_through_the_adapter_loads_at_other_world_sizes(tmp_path):
    root, out = str(tmp_path / "root"), str(tmp_path)
    _torchrun(2, root, out, "save")
    with AsyncCheckpointer(root, read_only=True) as reader:
        info = reader.latest()
    assert info is not None
    assert dcp_folders(info) == ["step-000000002/optimizer_0", "step-000000002/pytorch_model_fsdp_0"]
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    for nproc in (1, 3):
        _torchrun(nproc, root, out, "load")
        loaded = torch.load(tmp_path / f"loaded-{nproc}.pt", weights_only=False)
        assert_same_state(reference, loaded, f"at {nproc} process(es)")
    # Accelerate's stock load_fsdp_model reads the model folder with DCP's FileSystemReader.
    model = reference["model"]
    state = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
    dcp.load(
        state, storage_reader=FileSystemReader(f"{root}/step-000000002/pytorch_model_fsdp_0"), no_dist=True
    )
    assert all(torch.equal(state["model"][k], v) for k, v in model.items())
