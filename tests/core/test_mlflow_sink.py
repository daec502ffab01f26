"""MlflowSink against a real ``mlflow server`` on 127.0.0.1, and against none at all."""

from __future__ import annotations

import logging
import socket
import time

from air_core.session import MlflowSink, SessionConfig, TrainingSession
from air_core.session.mlflow_sink import RUN_KEY_TAG


def test_metrics_and_params_land_with_their_steps(mlflow_server):
    from mlflow import MlflowClient

    sink = MlflowSink(tracking_uri=mlflow_server.uri, experiment="sink-test", params={"lr": 0.1})
    for step in range(1, 2501):  # more than one log_batch of 1000
        sink.log({"x": step * 0.5, "y": 1.0}, step)
    sink.close(timeout_seconds=60)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    history = client.get_metric_history(sink.run_id, "x")
    assert sorted((m.step, m.value) for m in history) == [(s, s * 0.5) for s in range(1, 2501)]
    assert client.get_run(sink.run_id).data.params == {"lr": "0.1"}
    assert sink.dropped == 0 and sink.sent == 5000


def test_a_given_run_is_continued(mlflow_server):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    exp = client.get_experiment_by_name("sink-test") or client.get_experiment(
        client.create_experiment("sink-test")
    )
    run_id = client.create_run(exp.experiment_id).info.run_id
    sink = MlflowSink(run_id=run_id, tracking_uri=mlflow_server.uri)
    sink.log({"z": 3.0}, 7)
    sink.close(timeout_seconds=60)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "z")] == [(7, 3.0)]


def test_a_run_made_under_a_key_is_continued_by_a_sink_given_that_key(mlflow_server):
    """A sink names the run it will create by a key at once; a later sink given the key (from a checkpoint
    saved before the run's id was known) logs into that run rather than a new one."""
    from mlflow import MlflowClient

    first = MlflowSink(tracking_uri=mlflow_server.uri, experiment="sink-key")
    first.log({"x": 1.0}, 1)
    first.close(timeout_seconds=60)
    again = MlflowSink(tracking_uri=mlflow_server.uri, experiment="sink-key", run_key=first.run_key)
    assert again.run_key == first.run_key
    again.log({"x": 2.0}, 2)
    again.close(timeout_seconds=60)
    other = MlflowSink(tracking_uri=mlflow_server.uri, experiment="sink-key")
    other.log({"x": 3.0}, 3)
    other.close(timeout_seconds=60)
    assert first.run_id is not None and again.run_id == first.run_id and other.run_id != first.run_id
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "x")] == [(1, 1.0), (2, 2.0)]
    assert client.get_run(first.run_id).data.tags[RUN_KEY_TAG] == first.run_key


def test_a_launch_resumed_from_a_save_made_before_the_run_existed_logs_into_that_run(
    mlflow_server, monkeypatch
):
    """The sender creates the run in the background, so a save can come first: its rank state has no run
    id yet, only the key. The relaunch resumed from it continues the run, one run for the whole job."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    config = SessionConfig(mlflow_experiment="session-key", log_every_n_steps=1, owner="test")
    first = TrainingSession(config)
    first.start()
    state = first.rank_state()
    state["mlflow_run_id"] = None  # what a save before the sender reached the server holds
    assert state["mlflow_run_key"]
    for step in (1, 2):
        first.record_fetch(0.0)
        first.record_step(step)
    first.close(2)
    relaunch = TrainingSession(config)
    relaunch.positions.restore({0: state}, what="the checkpoint")
    relaunch.start(step=2)
    for step in (3, 4):
        relaunch.record_fetch(0.0)
        relaunch.record_step(step)
    relaunch.close(4)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    experiment = client.get_experiment_by_name("session-key")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "one MLflow run for the job, not one per launch"
    steps = {m.step for m in client.get_metric_history(runs[0].info.run_id, "fetch_seconds")}
    assert {1, 2, 3, 4} <= steps, f"both launches' steps in it: {sorted(steps)}"


def test_an_unreachable_server_never_raises_into_the_loop_and_warns_once(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with caplog.at_level(logging.WARNING, logger="air_core.session.mlflow_sink"):
        sink = MlflowSink(tracking_uri=f"http://127.0.0.1:{port}", retries=0, flush_every_seconds=0.1)
        started = time.perf_counter()
        for step in range(20_000):
            sink.log({"x": 1.0}, step)
        per_call = (time.perf_counter() - started) / 20_000
        sink.close(timeout_seconds=5)
    print(f"MlflowSink.log: {per_call * 1e6:.2f} us per call while the server is down")
    assert sink.sent == 0 and sink.run_id is None
    warnings = [
        r for r in caplog.records if r.name == "air_core.session.mlflow_sink" and r.levelno == logging.WARNING
    ]
    assert 1 <= len(warnings) <= 2, [r.getMessage() for r in warnings]
    assert "MLflow" in warnings[0].getMessage()


def test_a_given_runs_id_is_known_before_the_sender_connects():
    """A resumed job's checkpoints name the run its metrics go to from the first save on, which can come
    before the sender thread reached the server (a save under load came before it, and the relaunch
    after a crash then logged into a new run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there: the sender never connects
    sink = MlflowSink(run_id="0123abcd", tracking_uri=f"http://127.0.0.1:{port}", retries=0)
    try:
        assert sink.run_id == "0123abcd"
    finally:
        sink.close(timeout_seconds=5)


def test_the_callers_active_run_is_used_when_no_run_is_given(mlflow_server):
    import mlflow

    mlflow.set_tracking_uri(mlflow_server.uri)
    mlflow.set_experiment("active-run")
    with mlflow.start_run() as run:
        sink = MlflowSink(tracking_uri=mlflow_server.uri)
        sink.log({"a": 1.0}, 1)
        sink.close(timeout_seconds=60)
    assert sink.run_id == run.info.run_id


def test_a_run_the_sink_owns_ends_with_the_status_given_and_one_it_does_not_stays_open(mlflow_server):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    owned = MlflowSink(tracking_uri=mlflow_server.uri, experiment="sink-end", end_run=True)
    owned.log({"x": 1.0}, 1)
    owned.close(timeout_seconds=60, status="FAILED")
    assert client.get_run(owned.run_id).info.status == "FAILED"
    borrowed = MlflowSink(tracking_uri=mlflow_server.uri, experiment="sink-end")  # a framework logger's run
    borrowed.log({"x": 1.0}, 1)
    borrowed.close(timeout_seconds=60)
    assert client.get_run(borrowed.run_id).info.status == "RUNNING", "the logger that made it ends it"


def test_tags_land_with_the_latest_value_of_each_key(mlflow_server):
    from mlflow import MlflowClient

    sink = MlflowSink(tracking_uri=mlflow_server.uri, experiment="sink-test", flush_every_seconds=0.1)
    sink.tag("straggler.node-a", "step 8: rank 1")
    sink.tag("straggler.node-a", "step 16: rank 1")  # the latest value of a key wins
    sink.tag("straggler.node-b", "step 16: rank 3")
    sink.log({"x": 1.0}, 1)
    sink.close(timeout_seconds=60)
    tags = MlflowClient(tracking_uri=mlflow_server.uri).get_run(sink.run_id).data.tags
    assert tags["straggler.node-a"] == "step 16: rank 1" and tags["straggler.node-b"] == "step 16: rank 3"
