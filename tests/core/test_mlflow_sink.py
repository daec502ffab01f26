"""MlflowSink against a real ``mlflow server`` on 127.0.0.1, and against none at all."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import time
import uuid

import pytest

from air_core.session import MlflowSink, SessionConfig, TrainingSession
from air_core.session.mlflow_sink import RUN_KEY_TAG
from tests.conftest import REPO
from tests.core.test_goodput import _wait_unlocked
from tests.zygote import python


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


_KILLED_SINK = """
import os, signal, sys, time
from air_core.session import MlflowSink
uri, journal, run_key, steps, run_id = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
sink = MlflowSink(tracking_uri=uri, experiment="sink-journal", run_key=run_key, journal_dir=journal,
                  run_id=run_id or None, flush_every_seconds=600)  # nothing is sent before the kill
for step in range(1, steps + 1):
    sink.log({"loss": 1.0 / step, "fetch_seconds": 0.001 * step}, step)
print("ready", flush=True)
if sys.argv[6:] == ["stay"]:
    time.sleep(600)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_sink(
    uri: str, journal, run_key: str, steps: int, run_id: str = "", *, stay: bool = False
) -> subprocess.Popen:
    """A sink in another process that logged ``steps`` steps and was SIGKILLed (``stay``: still lives)."""
    argv = [python(), "-c", _KILLED_SINK, uri, str(journal), run_key, str(steps), run_id, *(["stay"] * stay)]
    p = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    if stay:
        return p
    assert p.wait(60) == -signal.SIGKILL
    for dead in journal.iterdir():
        _wait_unlocked(dead)  # the launcher may return before the child's exit has closed every file
    return p


@pytest.mark.parametrize("resumed", [True, False], ids=["resumed-same-run", "new-run"])
def test_a_killed_sinks_metrics_reach_its_run_through_the_next_sink_on_the_node(
    mlflow_server, tmp_path, resumed
):
    """SIGKILLed before its sender sent anything, a sink's metrics are in its node-local journal; the next
    sink given that folder sends them to the run they were logged for: its own run when it resumed the
    killed one (the checkpoint's key), else the killed sink's run, made under its key."""
    from mlflow import MlflowClient

    journal = tmp_path / "node" / ".air-journal"
    killed_key = uuid.uuid4().hex
    _killed_sink(mlflow_server.uri, journal, killed_key, steps=30)
    assert [p.suffix for p in journal.iterdir()] == [".mlflow"]
    sink = MlflowSink(
        tracking_uri=mlflow_server.uri,
        experiment="sink-journal",
        run_key=killed_key if resumed else None,
        journal_dir=str(journal),
    )
    sink.log({"loss": 0.5}, 31)
    sink.close(timeout_seconds=60)
    assert sink.taken_up == 60 and sink.dropped == 0
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    exp = client.get_experiment_by_name("sink-journal")
    (killed_run,) = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{killed_key}'"
    )
    loss = sorted((m.step, m.value) for m in client.get_metric_history(killed_run.info.run_id, "loss"))
    fetch = sorted(
        (m.step, m.value) for m in client.get_metric_history(killed_run.info.run_id, "fetch_seconds")
    )
    assert fetch == [(s, 0.001 * s) for s in range(1, 31)]
    assert loss == [(s, 1.0 / s) for s in range(1, 31)] + ([(31, 0.5)] if resumed else [])
    assert (sink.run_id == killed_run.info.run_id) is resumed
    assert not journal.exists(), "each journal goes once its metrics are sent, the emptied folder with them"


def test_a_live_sinks_journal_is_left_to_it_and_taken_up_once_its_process_is_gone(mlflow_server, tmp_path):
    """A journal is locked while its process lives: another sink on the node leaves it alone, and takes it
    up at a later send once that process has died (a launch still ending when the next one started)."""
    journal = tmp_path / ".air-journal"
    live = _killed_sink(mlflow_server.uri, journal, uuid.uuid4().hex, steps=5, stay=True)
    try:
        sink = MlflowSink(
            tracking_uri=mlflow_server.uri,
            experiment="sink-journal",
            journal_dir=str(journal),
            flush_every_seconds=0.1,
        )
        sink.log({"x": 1.0}, 1)
        deadline = time.monotonic() + 60
        while sink.sent < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sink.sent == 1 and sink.taken_up == 0, "a live process's journal is its own"
    finally:
        live.kill()
        live.wait()
    deadline = time.monotonic() + 60
    while sink.taken_up < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    sink.close(timeout_seconds=60)
    assert sink.taken_up == 10 and not journal.exists()


def test_a_killed_sinks_metrics_for_a_run_deleted_since_are_dropped_once_with_a_warning(
    mlflow_server, tmp_path, caplog
):
    """A journal whose run is gone can never be sent: it is dropped, not warned about at every launch."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    exp = client.get_experiment_by_name("sink-journal") or client.get_experiment(
        client.create_experiment("sink-journal")
    )
    run_id = client.create_run(exp.experiment_id).info.run_id
    journal = tmp_path / ".air-journal"
    _killed_sink(mlflow_server.uri, journal, uuid.uuid4().hex, steps=3, run_id=run_id)
    client.delete_run(run_id)
    with caplog.at_level(logging.WARNING, logger="air_core.session.mlflow_sink"):
        sink = MlflowSink(tracking_uri=mlflow_server.uri, experiment="sink-journal", journal_dir=str(journal))
        sink.close(timeout_seconds=60)
    assert sink.taken_up == 0 and not journal.exists()
    assert any("dropped 6 metric(s)" in r.getMessage() for r in caplog.records), caplog.text


def test_a_live_sink_keeps_only_what_it_has_not_sent_in_its_journal(mlflow_server, tmp_path):
    """One journal file per send: a sent one is removed, so the node-local folder holds at most the
    metrics since the last send, and nothing once the sink closed."""
    journal = tmp_path / ".air-journal"
    sink = MlflowSink(tracking_uri=mlflow_server.uri, journal_dir=str(journal), flush_every_seconds=0.05)
    for step in range(1, 201):
        sink.log({"x": float(step)}, step)
        time.sleep(0.002)

    def unsent() -> tuple[int, list[str]]:  # the journal files, and the metric lines they hold
        files = [p.read_text() for p in journal.iterdir()]
        return len(files), [line for text in files for line in text.splitlines()[1:]]  # less each header

    deadline = time.monotonic() + 60  # the sender removes a file just after its send counted
    while (sink.sent < 200 or unsent()[0] > 1 or unsent()[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sink.sent == 200 and unsent()[0] <= 1 and unsent()[1] == [], unsent()
    sink.close(timeout_seconds=60)
    assert not journal.exists()


def test_a_sink_made_while_another_thread_imports_mlflow_does_not_raise(monkeypatch):
    """A sink's sender imports mlflow on its own thread; a second sink made meanwhile (a notebook's next
    ``fit``) looked for the caller's active run in the half-imported module and raised AttributeError."""
    import sys
    import types

    from air_core.session.mlflow_sink import active_run_id

    monkeypatch.setitem(sys.modules, "mlflow", types.ModuleType("mlflow"))  # as a half-done import leaves it
    assert active_run_id() is None
