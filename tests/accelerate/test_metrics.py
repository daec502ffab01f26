"""An Accelerate job's metrics in a real MLflow server, across a crash, and with the server gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from air_core.session import goodput_of
from air_core.session.goodput import read_events, restores
from air_core.storage import Storage
from tests.accelerate.runs import JOB, run_job
from tests.conftest import REPO, start_mlflow_server
from tests.sameness import assert_same_run
from tests.zygote import python

pytestmark = pytest.mark.slow


def _run(client, experiment: str):
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, f"one run, found {len(runs)}"
    return runs[0].info.run_id


def _steps(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_metrics_land_in_the_trackers_run_with_their_steps(tmp_path, mlflow_server):
    from mlflow import MlflowClient

    run_job(tmp_path, "--mlflow", mlflow_server.uri, "--tracker", "--every", "5", "--experiment", "steps")
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run_id = _run(client, "steps")
    assert _steps(client, run_id, "loss") == list(range(48)), "Accelerate's own tracker logs here"
    assert _steps(client, run_id, "fetch_seconds") == list(range(1, 49)), "one per training step"
    assert _steps(client, run_id, "fetch_seconds_p95") == [8, 16, 24, 32, 40, 48], "one per window"
    assert _steps(client, run_id, "data_wait_fraction") == [8, 16, 24, 32, 40, 48]
    assert _steps(client, run_id, "checkpoint_blocking_seconds") == list(range(5, 46, 5))
    data = client.get_run(run_id).data.metrics
    assert data["checkpoints_committed_total"] == 9
    assert 0 < data["goodput"] < 1 and data["goodput_launches"] == 1


def test_a_resumed_job_continues_its_run_and_its_goodput_accounts_for_the_crash(tmp_path, mlflow_server):
    from mlflow import MlflowClient

    args = (
        "--mlflow",
        mlflow_server.uri,
        "--tracker",
        "--every",
        "5",
        "--epochs",
        "2",
        "--experiment",
        "resumed",
    )
    # Fresh interpreters (not tests/zygote.py's forks): the goodput log counts from each process's start.
    fresh = sys.executable
    first_started = time.time()
    run_job(tmp_path, *args, "--kill", "10:upload_start", expect_signal=signal.SIGKILL, interpreter=fresh)
    killed_at = time.time()
    time.sleep(2.0)  # the scheduler's delay before the relaunch: lost time that no step covers
    run_job(tmp_path, *args, interpreter=fresh)
    ended = time.time()
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run_id = _run(client, "resumed")  # the relaunch logged into the first launch's run, and left no other
    # The relaunch's steps (6-32), and the killed launch's (1-10): SIGKILLed before its sender's next
    # send, it left them in its node-local journal, which the relaunch's sink sent to the run.
    assert set(range(1, 33)) <= set(_steps(client, run_id, "fetch_seconds"))
    assert _steps(client, run_id, "restore_seconds") == [5]

    storage = Storage(str(tmp_path / "ckpts"), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    ((_, _, lost),) = restores(read_events(storage))
    # Killed while step 10's save uploaded: every step it ran is in its journal, put at the root by the
    # relaunch (the same node), so the restore lost at least steps 6-10.
    assert lost is not None and lost >= 5, "the killed launch's log reaches step 10"
    (logged,) = client.get_metric_history(run_id, "restore_lost_steps")
    assert (logged.step, logged.value) == (5, lost), "the steps the restore lost, as air report counts them"
    g = goodput_of(storage)
    assert g.launches == 2
    # From the first process's start to the last event: at least until the relaunch recorded its last
    # step (the ids file's last write; a start taken after the first launch's imports would fall short
    # by seconds), at most what the test's clock saw. (Not "less 3 s of teardown": a loaded machine
    # takes longer to end a process.)
    last_step = (tmp_path / "ids-rank0.jsonl").stat().st_mtime
    assert last_step - first_started - 1.0 <= g.wall <= ended - first_started, (
        g.wall,
        last_step - first_started,
        ended - first_started,
    )
    assert g.other >= 2.0 - 0.2, "the gap between the launches is lost time, not productive"
    assert (g.steps, g.recomputed_steps) == (5 + lost + 27, lost), "every step of both launches is in the log"
    assert g.goodput < (ended - killed_at) / (ended - first_started), "the crash cost goodput"
    parts = g.productive + g.checkpoint_stalls + g.data_waits + g.startup + g.restore + g.recomputed + g.other
    assert parts == pytest.approx(g.wall)


def test_training_goes_on_when_the_mlflow_server_goes_away(tmp_path):
    # Only air's sink talks to MLflow here: Accelerate's own tracker logs on the training thread and
    # would wait out its HTTP retries (the problem this layer avoids).
    reference = tmp_path / "reference"
    reference.mkdir()
    run_job(reference, "--epochs", "6")
    server = start_mlflow_server(str(tmp_path / "server"))
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=server.uri)
    workdir = tmp_path / "run"
    workdir.mkdir()
    job = subprocess.Popen(
        [python(), JOB, str(workdir), "--epochs", "6", "--mlflow", server.uri, "--experiment", "gone"],
        env={**os.environ, "PYTHONPATH": REPO},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None:
            found = client.get_experiment_by_name("gone")
            if found and client.search_runs([found.experiment_id]):
                break
            time.sleep(0.2)
        assert job.poll() is None, "the job was still training when the server went away"
        server.stop()
        _, stderr = job.communicate(timeout=300)
    finally:
        server.stop()
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert_same_run(workdir, reference)
    ours = [line for line in stderr.splitlines() if line.startswith("air_core.session.mlflow_sink WARNING")]
    assert len(ours) <= 2, ours
