"""Pre-flight checks on real parts: local folders, an S3 API server on 127.0.0.1 (stopped, or never
answering), gloo jobs under torchrun with a fault on one rank, Lightning's DDP and AirAccelerator."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

import tests.faultfs  # noqa: F401  (registers flaky://)
from air_core import HealthCheckError
from air_core.cli import main as air
from air_core.health import gpu, run_preflight
from air_core.health.checks import check_memory, check_staging, check_storage
from tests.conftest import REPO, run_python, with_private_shm
from tests.zygote import python

WORKER = os.path.join(REPO, "tests/health/preflight_worker.py")
HOST = socket.gethostname()


# -- one node ------------------------------------------------------------------------------------
def test_a_healthy_node_passes_and_air_preflight_exits_0_with_a_json_report(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert (
        air(
            [
                "preflight",
                str(tmp_path / "root"),
                "--staging-dir",
                str(tmp_path / "stage"),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["status"] == "ok" and report["exit_code"] == 0
    by_check = {r["check"]: r for r in report["results"]}
    assert {"storage", "staging", "memory", "gpu"} <= set(by_check)
    assert by_check["storage"]["status"] == "ok" and by_check["staging"]["data"]["write_mib_per_s"] > 0
    assert by_check["gpu"]["status"] in ("skipped", "ok")  # no NVIDIA driver on CI: skipped with a note
    assert all(HOST in line for line in printed.splitlines()[:-1])  # every line names the host
    assert sorted(os.listdir(tmp_path)) == ["report.json"], "the canary was deleted, no folder was made"


def test_air_preflight_exit_codes_bad_node_2_usage_64(tmp_path, capsys):
    root = str(tmp_path / "root")
    assert air(["preflight", root, "--staging-dir", str(tmp_path), "--expected-bytes", str(1 << 60)]) == 2
    assert "BAD     staging" in capsys.readouterr().out
    assert air(["preflight", root, "--checks", "storage,disk"]) == 64
    assert "unknown check(s) ['disk']" in capsys.readouterr().err
    for bad in (["preflight", root, "--bogus"], ["--storage-options", "{", "preflight", root]):
        with pytest.raises(SystemExit) as exited:
            air(bad)
        assert exited.value.code == 64, f"{bad}: bad usage, not a bad node"
        assert "error:" in capsys.readouterr().err
    assert (
        air(["preflight", root, "--checks", "storage", "--host-budget-bytes", str(1 << 60)]) == 0
    )  # not run


def test_denied_credentials_are_bad_with_the_fix_named():
    result = check_storage(
        "flaky://bucket/run", storage_options={"permanent_error": "denied", "fail_on": "pipe"}
    )
    assert result.status == "bad" and HOST in result.line()
    assert "Check the credentials" in result.line()


def test_a_stopped_s3_server_and_one_that_never_answers_are_bad_within_the_timeout(monkeypatch):
    from moto.server import ThreadedMotoServer

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    import boto3

    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="run")
    options = {"client_kwargs": {"endpoint_url": endpoint}, "config_kwargs": {"retries": {"max_attempts": 1}}}
    assert check_storage("s3://run/job", storage_options=options).status == "ok"
    server.stop()
    stopped = check_storage("s3://run/job", storage_options=options, timeout=20)
    assert stopped.status == "bad" and "storage" in stopped.line()

    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(silent.accept()[0]), daemon=True).start()
    started = time.perf_counter()
    quiet = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}"}}
    hung = check_storage("s3://run/job", storage_options=quiet, timeout=2)
    assert hung.status == "bad" and "no answer within 2 s" in hung.message
    assert time.perf_counter() - started < 15  # bounded by the timeout, not by botocore's minute
    silent.close()


@pytest.mark.timeout(30)  # the canary's retries took 17 s (refused) or the check's whole timeout (silent)
def test_an_unreachable_s3_endpoint_is_bad_in_seconds_with_the_endpoint_as_the_fix(dead_s3_endpoint):
    options = {"client_kwargs": {"endpoint_url": dead_s3_endpoint}}
    result = check_storage("s3://air-run/job", storage_options=options, timeout=120)
    assert result.status == "bad" and "the network and storage_options: the endpoint" in result.line(), (
        result.line()
    )
    assert "bucket exists" not in result.line(), f"the endpoint is wrong, not the bucket: {result.line()}"


def test_staging_and_memory_judge_the_expected_checkpoint_size(tmp_path):
    assert check_staging(str(tmp_path), expected_bytes=1 << 20).status == "ok"
    full = check_staging(str(tmp_path), expected_bytes=1 << 60)
    assert full.status == "bad" and "needs about" in full.message and "staging_dir" in full.fix
    free = full.data["free_bytes"]
    assert check_staging(str(tmp_path), expected_bytes=free * 2 // 3).status == "warn"
    assert check_memory(1 << 60, expected_bytes=None).status == "bad"
    assert check_memory(None, expected_bytes=1 << 60).status == "warn"  # spills: a warning, not a stop
    assert check_memory(1 << 20, expected_bytes=None).status == "ok"


def test_a_full_staging_disk_is_bad_before_any_write_of_a_checkpoint(tmp_path):
    """A real file-size quota (RLIMIT_FSIZE): the timed write fails as it would on a full disk."""
    code = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
from air_core.health.checks import check_staging
r = check_staging(sys.argv[1], expected_bytes=None)
print(r.status, r.message)
"""
    done = run_python(code, str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("bad cannot write 16 MiB"), done.stdout


def test_a_staging_dir_that_is_a_file_says_so_and_a_full_disk_says_to_free_space(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_bytes(b"x")
    for folder in (a_file, a_file / "below"):
        result = check_staging(str(folder), expected_bytes=None)
        assert result.status == "bad" and result.message.startswith(f"{folder} is not a folder"), result
        assert "Free space" not in result.fix and "staging_dir" in result.fix, result.fix
    code = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
from air_core.health.checks import check_staging
print(check_staging(sys.argv[1], expected_bytes=None).fix)
"""
    done = run_python(code, str(tmp_path / "stage"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Free space on the staging disk"), done.stdout


# nvidia-smi --query-gpu=... --format=csv,noheader,nounits, as printed on real nodes
HEALTHY = """0, NVIDIA H200, 00000000:18:00.0, 0, [N/A], No, No, 0x0000000000000000
1, NVIDIA H200, 00000000:2A:00.0, 0, [N/A], No, No, 0x0000000000000001
"""
ECC = """0, NVIDIA H100 80GB HBM3, 00000000:18:00.0, 2, [N/A], Yes, No, 0x0000000000000000
1, NVIDIA H100 80GB HBM3, 00000000:2A:00.0, 0, [N/A], No, No, 0x0000000000000000
"""
HOT = """0, NVIDIA A100-SXM4-80GB, 00000000:07:00.0, [Not Supported], No, No, No, 0x0000000000000048
"""


def test_nvidia_smi_outputs_are_judged():
    ok = gpu.judge(gpu.parse(HEALTHY), expected=2)
    assert ok.status == "ok" and "2 x NVIDIA H200" in ok.message  # 0x1 = idle: not a problem
    bad = gpu.judge(gpu.parse(ECC), expected=2)
    assert bad.status == "bad"
    assert "GPU 0 (00000000:18:00.0): 2 uncorrectable ECC error(s)" in bad.message
    assert "row remapping pending" in bad.message and "Drain this node" in bad.fix
    hot = gpu.judge(gpu.parse(HOT), expected=1)
    assert hot.status == "warn" and "hardware slowdown" in hot.message and "hardware thermal" in hot.message
    assert gpu.judge(gpu.parse(HEALTHY), expected=4).status == "bad"  # GPUs missing
    with pytest.raises(ValueError, match="fields"):
        gpu.parse("0, NVIDIA H200\n")


# -- several ranks ---------------------------------------------------------------------------------
def _job(tmp_path, nproc: int, fault: str, faulty: int = 1) -> tuple[subprocess.CompletedProcess, list[dict]]:
    cmd = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += [WORKER, str(tmp_path / "root"), str(tmp_path), fault, str(faulty)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO}
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    return done, ranks


def test_two_healthy_ranks_pass_every_check(tmp_path):
    done, ranks = _job(tmp_path, 2, "none")
    assert done.returncode == 0, done.stderr[-3000:]
    assert {r["status"] for r in ranks} == {"ok"}
    lines = ranks[0]["lines"]
    assert any(line.startswith("OK      links") for line in lines)
    assert any(line.startswith("OK      clocks") for line in lines)
    print(f"pre-flight of 2 ranks: {max(r['seconds'] for r in ranks):.2f} s")


def test_a_rank_with_a_full_staging_disk_stops_every_rank_naming_its_host_and_check(tmp_path):
    done, ranks = _job(tmp_path, 2, "full-staging")
    assert done.returncode != 0  # torchrun reports the ranks' exit code 2
    for r in ranks:  # the same error on every rank, before any collective check ran
        assert r["status"] == "bad"
        assert f"BAD     staging    {HOST} rank 1: cannot write" in r["error"]
        assert "rank 0" not in r["error"] and "links" not in r["error"]


def test_a_slow_link_is_named_by_its_ranks_and_hosts(tmp_path):
    done, ranks = _job(tmp_path, 3, "slow-link")
    assert done.returncode == 0, done.stderr[-3000:]  # a warning does not stop the job
    links = next(line for line in ranks[0]["lines"] if "links" in line)
    assert links.startswith("WARN") and f"slowest link rank 1 ({HOST}) -> rank 2 ({HOST})" in links


def test_a_link_slow_only_at_its_first_timing_is_timed_again_and_passes(tmp_path):
    done, ranks = _job(tmp_path, 2, "blip")  # rank 1's 4 sends of the first round wait 100 ms each
    assert done.returncode == 0, done.stderr[-3000:]
    links = next(r for r in ranks[0]["results"] if r["check"] == "links")
    assert links["status"] == "ok" and links["data"]["retimed"] is True, links
    assert links["data"]["link_seconds"]["1->0"] < 0.1, links


def test_clock_skew_is_named(tmp_path):
    done, ranks = _job(tmp_path, 2, "clock-skew")
    assert done.returncode == 0, done.stderr[-3000:]
    clocks = next(line for line in ranks[0]["lines"] if "clocks" in line)
    assert clocks.startswith("WARN") and f"rank 1 on {HOST} ahead of rank 0" in clocks
    skew = float(clocks.split("clock skew ")[1].split(" s")[0])
    assert 4.5 < skew < 5.5


# -- through the adapters ----------------------------------------------------------------------------
LIGHTNING_DDP = """
import os, resource, signal, sys
if os.environ.get("LOCAL_RANK") == "1":  # rank 1's staging disk is full
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from air_core import HealthCheckError
from lightning_air import AirCallback, AirCheckpointIO

class Model(BoringModel):
    def training_step(self, batch, batch_idx):
        open(os.path.join(sys.argv[1], f"stepped-{self.global_rank}"), "w").close()
        return super().training_step(batch, batch_idx)

trainer = pl.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False, enable_progress_bar=False,
    enable_model_summary=False, plugins=[AirCheckpointIO(staging_dir=os.path.join(sys.argv[1], "stage"))],
    callbacks=[AirCallback(mlflow=False), ModelCheckpoint(dirpath=os.path.join(sys.argv[1], "ckpt"))],
)
try:
    trainer.fit(Model())
except HealthCheckError as exc:
    print(f"rank {trainer.global_rank}: {exc}", flush=True)
    sys.exit(2)
"""


def test_lightning_ddp_stops_on_every_rank_before_the_first_step(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(LIGHTNING_DDP)
    done = subprocess.run(
        [python(), str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert done.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank}: AirCallback: pre-flight failed on {HOST}" in done.stdout, (
            done.stdout + done.stderr[-3000:]
        )
    assert f"BAD     staging    {HOST} rank 1" in done.stdout
    assert not list(tmp_path.glob("stepped-*")), "no training step ran"


def test_air_accelerator_is_refused_at_construction_when_the_root_is_unwritable(tmp_path):
    from accelerate_air import AirAccelerator, AirPlugin

    plugin = AirPlugin(
        "flaky://bucket/run", storage_options={"permanent_error": "denied", "fail_on": "pipe"}, mlflow=False
    )
    with pytest.raises(HealthCheckError, match=rf"AirPlugin: pre-flight failed on {HOST}") as info:
        AirAccelerator(cpu=True, air_plugin=plugin)
    assert "BAD     storage" in str(info.value) and "credentials" in str(info.value)
    plugin = AirPlugin(str(tmp_path), preflight=["clocks"], mlflow=False)  # one rank: nothing between ranks
    AirAccelerator(cpu=True, air_plugin=plugin).end_training()


def test_run_preflight_with_no_checks_is_empty_and_ok():
    report = run_preflight((), root=None)
    assert report.results == [] and report.status == "ok" and report.exit_code == 0


def test_the_preflight_lands_in_the_goodput_log_air_report_and_mlflow(
    tmp_path, mlflow_server, monkeypatch, capsys
):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from mlflow.tracking import MlflowClient

    from lightning_air import AirCallback, AirCheckpointIO

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    root = str(tmp_path / "ckpt")
    callback = AirCallback(mlflow=True, mlflow_experiment="preflight", preflight=["storage", "staging"])
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AirCheckpointIO()],
        callbacks=[callback, ModelCheckpoint(dirpath=root)],
    )
    trainer.fit(BoringModel())
    capsys.readouterr()
    assert air(["report", root]) == 0
    assert "pre-flight (launch 1): ok in" in capsys.readouterr().out
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run = client.search_runs([client.get_experiment_by_name("preflight").experiment_id])[0]
    assert run.data.metrics["preflight_status"] == 0
    assert 0 < run.data.metrics["preflight_seconds"] < 60


def test_a_local_tier_on_dev_shm_leaves_room_for_the_loader_workers_batches(tmp_path):
    """A loader worker passes each batch through /dev/shm; with no room left there it drops the batch and
    its loader waits forever. A tier that fits in /dev/shm but leaves it under 1 GiB is a warning; the
    same need on a disk is not."""
    from air_core.health.checks import SHARED_MEMORY_HEADROOM, check_local_tier

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    folder = f"/dev/shm/air-preflight-test-{os.getpid()}/local"  # not made: the check probes /dev/shm
    free = shutil.disk_usage("/dev/shm").free
    # the tier's own part and its partner's copy, each a newest and one in flight: 4 x need, half a GiB left
    need = max((free - SHARED_MEMORY_HEADROOM // 2) // 4, 1)
    shm = check_local_tier(folder, expected_bytes=need, copies=1, probe_bytes=1 << 20)
    assert shm.status == "warn" and "DataLoader workers" in shm.message, shm.line()
    assert "--shm-size" in shm.fix, shm.line()
    need = min(need, shutil.disk_usage(tmp_path).free // 4)
    disk = check_local_tier(str(tmp_path), expected_bytes=need, copies=1, probe_bytes=1 << 20)
    assert disk.status == "ok", disk.line()


def test_a_process_writers_buffers_are_weighed_against_dev_shm():
    """``writer="process"`` keeps its buffers in /dev/shm (64 MiB in a default Docker container): too
    small for them beside the loader workers' room, its saves spill; pre-flight says so first."""
    code = """
from air_core.health.checks import check_memory
for shared in (True, False):
    print(check_memory(64 << 20, expected_bytes=None, shared=shared).line())
"""
    done = subprocess.run(
        with_private_shm([sys.executable, "-c", code]),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    shared, thread = done.stdout.splitlines()
    assert shared.startswith("WARN") and "writer='process' keeps them in /dev/shm" in shared, shared
    assert "--shm-size" in shared and "writer='thread'" in shared, shared
    assert thread.startswith("OK"), thread


def test_the_local_tier_folder_is_checked_against_what_the_tier_keeps(tmp_path):
    from air_core.health.checks import check_local_tier

    ok = check_local_tier(str(tmp_path / "local"), expected_bytes=1 << 20, copies=1)
    assert (ok.check, ok.status) == ("local", "ok") and ok.data["expected_bytes"] == 2 << 20
    bad = check_local_tier(str(tmp_path / "local"), expected_bytes=1 << 60, copies=1)
    assert bad.status == "bad" and "local_dir" in bad.fix
    report = run_preflight(["local"], root=None, local_dir=str(tmp_path / "local"), expected_bytes=1 << 20)
    assert [r.check for r in report.results] == ["local"]
    assert run_preflight(["local"], root=None).results == [], "no local tier: nothing to check"


def test_a_local_root_that_cannot_hold_a_folder_is_told_to_pass_a_writable_folder(tmp_path):
    """It was told to check 'the root URL, the network and storage_options'."""
    a_file = tmp_path / "file"
    a_file.write_bytes(b"x")
    for root in ("/proc/air/run", str(a_file / "run")):
        result = check_storage(root, storage_options={})
        assert result.status == "bad" and result.message.startswith(f"cannot write under {root}"), result
        assert result.fix.startswith("Pass a folder on a disk this process can write"), result.fix


def test_preflight_of_folders_not_there_yet_leaves_none_and_says_the_job_makes_them(tmp_path, capsys):
    """``air preflight /typo/root`` made the folders it checked, so the typo passed and stayed."""
    root, stage = tmp_path / "runs" / "a", tmp_path / "stage" / "x"
    assert air(["preflight", str(root), "--staging-dir", str(stage), "--checks", "storage,staging"]) == 0
    out = capsys.readouterr().out
    assert f"{root} does not exist yet (the job creates it); {tmp_path}, where it goes, is writable" in out
    assert (
        f"{stage}: " in out and f"(it does not exist yet, the job creates it; measured in {tmp_path})" in out
    )
    assert os.listdir(tmp_path) == [], "no folder made, no probe left"
    empty = tmp_path / "empty"  # a root that is there, without the .air/ a job's first save makes
    empty.mkdir()
    assert air(["preflight", str(empty), "--staging-dir", str(empty), "--checks", "storage,staging"]) == 0
    out = capsys.readouterr().out
    assert f"{empty} writable (canary put, read, deleted)" in out and "does not exist" not in out, out
    assert os.listdir(empty) == [], "no .air/ left in the root"
