"""Safety: a manifest naming paths outside the root is refused; loading unpickles with
``weights_only=True``; credentials in ``storage_options`` never reach logs, MLflow or the root."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch

from air_core import AsyncCheckpointer, ConfigError
from lightning_air import AirCheckpointIO
from tests.accelerate.runs import run_job

MARKER = Path(os.environ.get("TMPDIR", "/tmp")) / f"air-safety-marker-{os.getpid()}"


class Evil:
    """Unpickling it runs code (here: creates MARKER); ``weights_only=True`` must refuse it."""

    def __reduce__(self):
        return (Path.touch, (MARKER,))


@pytest.fixture(autouse=True)
def no_marker():
    MARKER.unlink(missing_ok=True)
    yield
    MARKER.unlink(missing_ok=True)


@pytest.mark.parametrize("path", ["../outside.bin", "/etc/hostname", "a/../../outside.bin"])
def test_a_manifest_naming_a_path_outside_the_root_is_refused(tmp_path, path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not yours")
    root = tmp_path / "root"
    with AsyncCheckpointer(str(root), keep_last=5) as ckpt:
        ckpt.save({"w": torch.ones(2)}, step=1).result(60)
        ckpt.save({"w": torch.zeros(2)}, step=2).result(60)
    # A hostile (or broken) writer points the newest manifest at a file outside the root.
    manifest = root / ".air/step-000000002/manifest.json"
    body = json.loads(manifest.read_text())
    data = outside.read_bytes()
    body["files"][0] |= {"path": path, "size": len(data), "crc32": zlib.crc32(data)}
    manifest.write_text(json.dumps(body))
    with AsyncCheckpointer(str(root), keep_last=1) as ckpt:
        (hostile,) = [i for i in ckpt.list() if i.name == "step-000000002"]
        assert hostile.status == "corrupt" and "refusing file path" in hostile.reason
        assert ckpt.latest().step == 1, "the refused checkpoint is skipped"
        assert torch.equal(ckpt.load()["w"], torch.ones(2))
        ckpt.save({"w": torch.full((2,), 3.0)}, step=3).result(60)  # retention runs: never outside the root
        ckpt.save({"w": torch.full((2,), 4.0)}, step=4).result(60)
    assert outside.read_bytes() == b"not yours"


def plant(root: Path, name: str, state: dict) -> None:
    """Replace the (only) file of committed checkpoint ``name`` with ``state``, and fix its manifest's
    size and checksum: what someone with write access to the root can do."""
    manifest = root / f".air/{name}/manifest.json"
    body = json.loads(manifest.read_text())
    target = root / body["files"][0]["path"]
    torch.save(state, target)
    data = target.read_bytes()
    body["files"][0] |= {"size": len(data), "crc32": zlib.crc32(data)}
    manifest.write_text(json.dumps(body))


def test_core_load_refuses_pickled_code_unless_told_to_trust_it(tmp_path):
    with AsyncCheckpointer(str(tmp_path)) as ckpt:
        ckpt.save({"w": torch.ones(2)}, step=1).result(60)
        plant(tmp_path, "step-000000001", {"w": torch.ones(2), "evil": Evil()})
        assert not MARKER.exists()
        with pytest.raises(ConfigError, match="weights_only=True refuses.*If you trust this checkpoint"):
            ckpt.load()
        assert not MARKER.exists(), "nothing in the checkpoint may run on a default load"
        ckpt.load(weights_only=False)
        assert MARKER.exists(), "the same file does run code when trusted: the test can fail"


def test_lightning_checkpoint_io_loads_with_weights_only(tmp_path):
    io = AirCheckpointIO()
    path = f"{tmp_path}/ckpts/epoch=0-step=1.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, path)
    info = io.session.last_handle.result(60)
    plant(
        tmp_path / "ckpts", info.name, {"state_dict": {"w": torch.ones(2)}, "global_step": 1, "evil": Evil()}
    )
    with pytest.raises(ConfigError, match="weights_only=True refuses"):
        io.load_checkpoint(path)  # Lightning passes weights_only=None: torch's default, True
    assert not MARKER.exists()
    io.teardown()


@pytest.mark.slow
def test_credentials_never_reach_logs_mlflow_manifests_or_staging(tmp_path, s3_root, mlflow_server):
    import boto3
    from mlflow import MlflowClient

    secret = "AIRSECRET-do-not-leak-7f3a"
    out = run_job(
        tmp_path,
        *("--root", s3_root.url, "--endpoint", s3_root.endpoint, "--secret", secret, "--debug"),
        *("--mlflow", mlflow_server.uri, "--experiment", "secrets", "--every", "8"),
    )
    assert "committed checkpoint" in out.stderr, "the job logged at DEBUG"
    assert secret not in out.stderr + out.stdout
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("secrets").experiment_id])
    assert secret not in json.dumps({"params": run.data.params, "tags": run.data.tags})
    bucket = s3_root.url.split("/")[2]
    s3 = boto3.client("s3", endpoint_url=s3_root.endpoint, region_name="us-east-1")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert any(k.endswith("manifest.json") for k in keys) and any(".air-events/" in k for k in keys)
    for key in keys:
        assert secret.encode() not in s3.get_object(Bucket=bucket, Key=key)["Body"].read(), key
    for path in (tmp_path / "nvme").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
