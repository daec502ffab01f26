"""A Lightning job's metrics in a real MLflow server: the MLFlowLogger's run is reused and continued."""

from __future__ import annotations

import pytest

from tests.lightning.test_crash_resume import run_job

pytestmark = pytest.mark.slow


def _steps(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_metrics_land_in_the_mlflow_loggers_run_and_a_resumed_fit_continues_it(tmp_path, mlflow_server):
    from mlflow import MlflowClient

    args = ["--mlflow", mlflow_server.uri, "--mlflow-logger", "--experiment", "lightning", "--every", "5"]
    run_job(tmp_path, *args, "--kill", "10:upload_start", expect_kill=True)
    run_job(tmp_path, *args)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    experiment = client.get_experiment_by_name("lightning")
    runs = client.search_runs([experiment.experiment_id])
    live = [r for r in runs if r.data.metrics.get("fetch_seconds_total")]
    assert len(live) == 1, "air's metrics went into one run"
    assert len(runs) == 1, "the run the relaunch's logger opened, left empty, is deleted"
    run_id = live[0].info.run_id
    assert _steps(client, run_id, "loss"), "the MLFlowLogger logs into the same run"
    assert set(range(6, 49)) <= set(_steps(client, run_id, "fetch_seconds")), "every step of the relaunch"
    # The killed launch's steps (1-10) too: SIGKILLed before its sender's next send, it left them in its
    # node-local journal, which the relaunch's sink sent to the run.
    assert set(range(1, 11)) <= set(_steps(client, run_id, "fetch_seconds")), "the killed launch's steps"
    assert _steps(client, run_id, "fetch_seconds_p95")[-1] == 48, "the last, partial window is published"
    assert set(_steps(client, run_id, "checkpoint_blocking_seconds")) >= set(range(10, 46, 5))
    assert _steps(client, run_id, "restore_seconds") == [5]
    metrics = client.get_run(run_id).data.metrics
    assert metrics["goodput_launches"] == 2 and 0 < metrics["goodput"] < 1
    # The killed launch's journal (the relaunch ran on its node) holds every step it ran: 6-10 at least.
    (lost,) = client.get_metric_history(run_id, "restore_lost_steps")
    assert lost.step == 5 and lost.value >= 5, (
        "the steps the restore lost, from the killed launch's whole log"
    )
    assert metrics["goodput_recomputed_steps"] == lost.value


def test_without_a_logger_a_new_run_is_made_at_the_tracking_uri(tmp_path, mlflow_server):
    from mlflow import MlflowClient

    run_job(tmp_path, "--mlflow", mlflow_server.uri, "--experiment", "lightning-plain", "--epochs", "1")
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("lightning-plain").experiment_id])
    assert _steps(client, run.info.run_id, "fetch_seconds") == list(range(1, 17))
    assert _steps(client, run.info.run_id, "data_wait_fraction") == [8, 16]
    assert not (tmp_path / "mlruns").exists(), "never MLflow's ./mlruns file store"
    assert run.info.status == "FINISHED", "the run the job started ends with the job"
