"""User mistakes fail at construction or at resume, before any training step, with a message that
names the argument, what is wrong and the fix: never a traceback from deep inside a framework."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from air_core import AsyncCheckpointer, ConfigError, StorageError
from tests.conftest import REPO
from tests.faults.trials import Plan, launch
from tests.zygote import python


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"root": "nosuch://bucket/run"}, r"root='nosuch://bucket/run'.*scheme fsspec knows"),
        ({"root": "/tmp/x", "keep_last": 0}, r"keep_last=0.*Pass keep_last=1 or more"),
        ({"root": "/tmp/x", "keep_last": "2"}, r"keep_last='2'.*an integer >= 1"),  # a string from YAML
        (
            {"root": "/tmp/x", "host_budget_bytes": 16},
            r"host_budget_bytes=16.*the unit is bytes.*16 \* 2\*\*30",
        ),
        ({"root": "/tmp/x", "staging_dir": "s3://b/nvme"}, r"staging_dir='s3://b/nvme'.*local disk"),
        ({"root": "/tmp/x", "max_transfers": 0}, r"max_transfers=0.*integer >= 1"),
        ({"root": "/tmp/x", "on_busy": "drop"}, r"on_busy='drop'.*one of wait, skip"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_fix(kwargs, match):
    root = kwargs.pop("root")
    with pytest.raises(ConfigError, match=match):
        AsyncCheckpointer(root, **kwargs)


def test_staging_dir_that_is_a_file_or_unwritable_fails_at_construction(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match=r"staging_dir=.*is not a folder.*Pass a folder on a local disk"):
        AsyncCheckpointer("memory://air-bad-input/run", staging_dir=str(a_file))  # by its settings
    with pytest.raises(ConfigError, match=r"staging_dir=.*cannot write.*pass a writable folder"):
        AsyncCheckpointer("memory://air-bad-input/run", staging_dir="/proc/air-staging")  # by a probe write


def test_a_local_root_that_cannot_be_made_names_a_folder_not_a_bucket():
    with pytest.raises(StorageError, match=r"/proc/air-root.*Pass a folder on a disk") as refused:
        AsyncCheckpointer("/proc/air-root", retries=0)
    assert "bucket" not in str(refused.value)


def test_missing_bucket_fails_at_construction(s3_root):
    url = s3_root.url.replace("air-", "missing-air-")
    with pytest.raises(StorageError, match="Check that the bucket exists"):
        AsyncCheckpointer(url, storage_options=s3_root.storage_options, retries=0)


def test_missing_credentials_fail_at_construction(s3_root, tmp_path, monkeypatch):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StorageError, match="Check the credentials"):
        AsyncCheckpointer(s3_root.url, storage_options=s3_root.storage_options, retries=0)


@pytest.mark.timeout(30)  # botocore's and our retries took a minute (refused) or forever (silent)
@pytest.mark.parametrize("read_only", [False, True], ids=["writer", "reader"])
def test_an_unreachable_s3_endpoint_fails_at_construction_in_seconds_naming_it(
    dead_s3_endpoint, tmp_path, read_only
):
    """A reader too (``latest_checkpoint``, ``air ls``): its first listing waited through every retry,
    more than ten minutes against an endpoint that never answers."""
    options = {"client_kwargs": {"endpoint_url": dead_s3_endpoint}}
    with pytest.raises(StorageError) as unreachable:
        AsyncCheckpointer(
            "s3://air-run/job", storage_options=options, staging_dir=str(tmp_path), read_only=read_only
        )
    message = str(unreachable.value)
    named = f"root='s3://air-run/job') cannot reach its storage at endpoint_url='{dead_s3_endpoint}'"
    assert f"AsyncCheckpointer({named}" in message, message
    assert "the network and storage_options: the endpoint" in message, (
        f"the fix names the argument: {message}"
    )
    assert "bucket exists" not in message, f"the endpoint is wrong, not the bucket: {message}"


@pytest.mark.slow
def test_accelerate_resume_into_another_model_is_refused_before_any_step(tmp_path):
    plan = Plan("accelerate", 0, workers=0, s3=False, processes=1, launches=[])
    rc, stderr = launch(plan, tmp_path, ["--epochs", "1"], None)
    assert rc == 0, stderr[-3000:]
    steps = len((tmp_path / "ids-rank0.jsonl").read_text().splitlines())
    rc, stderr = launch(plan, tmp_path, ["--epochs", "2", "--width", "48"], None)
    assert rc != 0
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("air_core.errors.ConfigError: AirAccelerator.load_state: step-000000016/"), last
    assert "saved from a different model (shape of 0.weight: saved (32, 16), model (48, 16)" in last
    assert "Resume with the model it was saved from" in last
    assert len((tmp_path / "ids-rank0.jsonl").read_text().splitlines()) == steps, "no training step ran"


@pytest.mark.slow
def test_lightning_cli_resume_into_another_model_is_refused_before_any_step(tmp_path):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [python(), os.path.join(REPO, "examples/lightning/train.py"), "fit"]
            + ["--config", os.path.join(REPO, "examples/lightning/config.yaml"), *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": REPO},
        )

    first = cli("--trainer.max_epochs", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    steps = len((tmp_path / "ids.jsonl").read_text().splitlines())
    second = cli("--trainer.max_epochs", "2", "--model.hidden", "128")
    assert second.returncode != 0
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("air_core.errors.ConfigError: checkpoint ckpt-000000032-"), last
    assert (
        "saved from a different model (shape of" in last and "Resume with the model it was saved from" in last
    )
    assert len((tmp_path / "ids.jsonl").read_text().splitlines()) == steps, "no training step ran"


def test_a_state_beyond_the_host_budget_spills_and_says_so_once(tmp_path, caplog):
    state = {"big": torch.arange(600_000, dtype=torch.float32), "small": torch.ones(3)}  # 2.4 MB
    with AsyncCheckpointer(
        str(tmp_path), host_budget_bytes=1 << 20, staging_dir=str(tmp_path / "nvme")
    ) as ckpt:
        for step in (1, 2):
            ckpt.save(state, step=step).result(60)
        assert torch.equal(ckpt.load()["big"], state["big"]), "nothing is lost to the spill"
    warnings = [r.getMessage() for r in caplog.records if "host_budget_bytes=1048576" in r.getMessage()]
    assert len(warnings) == 1, "said once, not at every save"
    assert "largest tensor is 2400000 bytes" in warnings[0] and "Raise host_budget_bytes" in warnings[0]
