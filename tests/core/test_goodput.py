"""Goodput: the event log's segments round-trip through storage, and the split of wall time is exact."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from air_core import RestoreRecord, SaveRecord
from air_core.session import GoodputLog, goodput_of
from air_core.session.goodput import analyze, per_launch, read_events
from air_core.session.metrics import Recorder
from air_core.storage import Storage
from tests.conftest import REPO
from tests.zygote import python


def _launch(
    start: float, steps: list[tuple[int, float, float, float]], restore: int | None = None
) -> list[dict]:
    """Events of one launch: steps as (step, end time, duration, fetch)."""
    events = [{"e": "start", "t": start, "launch": "x"}]
    if restore is not None:
        events.append({"e": "restore", "s": restore, "t": start + 1, "seconds": 0.5, "source": "cache"})
    events += [{"e": "step", "s": s, "t": t, "d": d, "f": f} for s, t, d, f in steps]
    return events


def test_the_wall_time_of_a_killed_and_resumed_job_splits_exactly():
    # Launch 1: starts at 0, first step ends at 10 (2 s long: 8 s start-up), steps 1-4 of 1 s (0.1 s
    # data wait each), a save after step 2 blocking 0.3 s (inside step 3); killed after step 4.
    first = _launch(0.0, [(1, 10.0, 2.0, 0.1), (2, 11.0, 1.0, 0.1), (3, 12.0, 1.0, 0.1), (4, 13.0, 1.0, 0.1)])
    first.append({"e": "save", "s": 2, "t": 11.5, "blocking": 0.3, "committed": True, "total": 0.5})
    # Launch 2 starts at 20, restores step 2 (steps 3-4 of launch 1 were for nothing), runs 3-4 again.
    second = _launch(20.0, [(3, 25.0, 1.0, 0.2), (4, 26.0, 1.0, 0.2)], restore=2)
    second.append({"e": "end", "t": 27.0})
    g = analyze([first, second])
    assert g.wall == 27.0 and g.launches == 2 and g.steps == 6 and g.recomputed_steps == 2
    assert g.recomputed == 2.0, "launch 1's steps 3 and 4"
    assert g.restore == 0.5, "launch 2's restore record, before its first step"
    assert g.startup == pytest.approx(8.0 + 3.5), "start to first step start, per launch, less the restore"
    assert g.data_waits == pytest.approx(0.1 + 0.1 + 0.2 + 0.2)
    assert g.checkpoint_stalls == 0.0, "the save's stall fell in step 3 of launch 1, which was recomputed"
    assert g.productive == pytest.approx((2.0 - 0.1) + (1.0 - 0.1) + (1.0 - 0.2) * 2)
    parts = g.productive + g.checkpoint_stalls + g.data_waits + g.startup + g.restore + g.recomputed + g.other
    assert parts == pytest.approx(g.wall)
    assert g.goodput == pytest.approx(g.productive / 27.0)
    report = g.report()
    assert "start-up (imports, process group)" in report and "  restore " in report, report
    assert g.as_metrics()["goodput_restore_seconds"] == 0.5


def test_an_evaluation_before_the_first_step_is_not_start_up():
    # A resume at an epoch's end evaluates before its first step: start-up ends at the first evaluation
    # batch, and the evaluation (10 s) is "other", as an evaluation between steps is.
    events = _launch(0.0, [(1, 20.0, 1.0, 0.0)], restore=4)
    events.insert(2, {"e": "eval", "t": 3.0})
    g = analyze([events])
    assert (g.startup, g.restore) == (2.5, 0.5), f"start to the first evaluation batch, less the restore: {g}"
    assert g.other == pytest.approx(16.0), "the evaluation, up to the first step's start"


def test_the_recorder_logs_the_evaluation_before_the_first_step_once(tmp_path):
    storage = Storage(str(tmp_path), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    log = GoodputLog(storage, "e" * 32, flush_every_seconds=600)
    records = Recorder(rank=0)
    records.goodput = log
    records.record_evaluation()  # the first batch of an evaluation before any step
    time.sleep(0.2)
    records.record_evaluation()  # its later batches
    records.record_fetch(0.0)
    records.record_step(1)
    records.record_evaluation()  # an evaluation inside training
    log.close()
    (events,) = read_events(storage)
    assert [e["e"] for e in events] == ["start", "eval", "step", "end"]
    start, evaluated, step = events[:3]
    assert analyze([events]).startup == pytest.approx(evaluated["t"] - start["t"]), "not to the step's start"
    assert step["t"] - step["d"] - evaluated["t"] >= 0.2


def test_only_a_restore_before_the_first_step_counts_as_restore():
    events = _launch(0.0, [(1, 10.0, 1.0, 0.0), (2, 14.0, 1.0, 0.0)])
    # A load after step 1 (a notebook's ``load`` mid-run) is not the launch's restore.
    events.append({"e": "restore", "s": 1, "t": 12.0, "seconds": 2.0, "source": "cache"})
    g = analyze([events])
    assert (g.startup, g.restore) == (9.0, 0.0), f"start-up is start to first step start: {g}"
    events = _launch(0.0, [(1, 3.0, 1.0, 0.0)])
    events.insert(1, {"e": "restore", "s": 5, "t": 1.5, "seconds": 5.0, "source": "remote"})
    g = analyze([events])
    assert (g.startup, g.restore) == (0.0, 2.0), f"the restore is capped at the time before the step: {g}"


def test_the_log_survives_as_segments_and_reads_back_in_order(tmp_path):
    storage = Storage(str(tmp_path), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    log = GoodputLog(storage, "a" * 32, flush_every_seconds=60)
    log.step(1, 0.5, 0.1)
    log.save(SaveRecord("c", 1, 0, 0.0, 0.02, 0.1, 0.0, 0.01, 0.2, 10, 0))  # a commit writes a segment
    deadline = time.monotonic() + 10
    while not storage.sizes(".air-events") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert storage.sizes(".air-events"), "the commit made the log durable up to it, without waiting 60 s"
    log.restore(RestoreRecord("c", 1, 0, 0.3, "remote", 10))
    log.step(2, 0.5, 0.1)
    log.close()
    (events,) = read_events(storage)
    assert [e["e"] for e in events] == ["start", "step", "save", "restore", "step", "end"]
    segments = [p for p in storage.sizes(".air-events") if p.endswith(".jsonl")]
    assert len(segments) >= 2, "the commit flushed a segment before close wrote the last one"
    assert goodput_of(storage).steps == 2


_KILLED_LAUNCH = """
import os, signal, sys, time
from air_core.session import GoodputLog
from air_core.storage import Storage
root, journal, stay = sys.argv[1], sys.argv[2], sys.argv[3] == "stay"
storage = Storage(root, storage_options={}, retries=0, retry_backoff_seconds=0.0)
log = GoodputLog(storage, sys.argv[4] * 32, flush_every_seconds=600, journal_dir=journal)
def started():  # the start segment is written at once; its temp file (".<name>.air-tmp-<id>") is not it
    return any(f"-{sys.argv[4] * 8}/" in p and p.endswith(".jsonl") for p in storage.sizes(".air-events"))
while not started():
    time.sleep(0.01)
for s in range(1, 6):
    log.step(s, 0.5, 0.1)
print("ready", flush=True)
if stay:
    time.sleep(600)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_launch(root, journal, letter: str, *, stay: bool = False) -> subprocess.Popen:
    argv = [python(), "-c", _KILLED_LAUNCH, str(root), str(journal), "stay" if stay else "die", letter]
    p = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def test_a_killed_launch_s_events_come_back_from_its_node_local_journal(tmp_path):
    storage = Storage(str(tmp_path / "root"), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    journal = tmp_path / "node-local"
    killed = _killed_launch(tmp_path / "root", journal, "a")
    assert killed.wait(60) == -signal.SIGKILL
    (dead,) = journal.iterdir()
    _wait_unlocked(dead)  # the launcher may return before the child's exit has closed every file
    (events,) = read_events(storage)
    assert [e["e"] for e in events] == ["start"], "no segment after the start: the steps died with it"
    live = _killed_launch(tmp_path / "root", journal, "b", stay=True)  # a launch still running
    try:
        log = GoodputLog(storage, "c" * 32, flush_every_seconds=600, journal_dir=str(journal))
        log.step(6, 0.5, 0.1)
        log.close()
        # Launch b puts a's journal too when it starts: whichever of b and c locked it first puts it and
        # then removes it, b maybe a moment after c closed (a race of the test's, not a leak: c found it
        # locked). Its removal comes after its events are at the root.
        deadline = time.monotonic() + 30
        while len(left := [name[-7:] for name in os.listdir(journal)]) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left == ["b.jsonl"], "the dead launch's journal was put at the root and removed, c's removed"
        launches = {events[0]["launch"][0]: [e["e"] for e in events] for events in read_events(storage)}
        assert launches == {
            "a": ["start", "step", "step", "step", "step", "step"],  # from the dead launch's journal
            "b": ["start"],  # the live launch's segments so far: its journal is left to it
            "c": ["start", "step", "end"],
        }
        assert goodput_of(storage).steps == 6
    finally:
        live.kill()
        live.wait()
    (ended,) = journal.iterdir()
    _wait_unlocked(ended)
    # The root removed (a new run under the same root): an old launch's journal is not this run's.
    shutil.rmtree(tmp_path / "root")
    log = GoodputLog(storage, "d" * 32, flush_every_seconds=600, journal_dir=str(journal))
    log.close()
    assert len(read_events(storage)) == 1
    assert not journal.exists() and tmp_path.exists(), "its emptied folder goes, a parent holding more stays"


def test_a_closed_launch_leaves_no_empty_folder_of_this_root_on_the_node(tmp_path):
    node_folder = tmp_path / "air-spill" / "0123456789abcdef"  # as a root written in place has it
    storage = Storage(str(tmp_path / "root"), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    log = GoodputLog(storage, "e" * 32, journal_dir=str(node_folder / ".air-journal"))
    log.close()
    assert read_events(log.storage) and not node_folder.exists() and (tmp_path / "air-spill").exists()


def _wait_unlocked(path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with open(path, "r+b") as f:
        while True:
            try:
                fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return  # closing the file releases it
            except OSError:
                assert time.monotonic() < deadline, f"{path} still locked after {timeout} s"
                time.sleep(0.05)


def test_a_launch_whose_restore_event_was_lost_resumed_from_the_step_before_its_first():
    first = _launch(0.0, [(s, 10.0 + s, 1.0, 0.0) for s in range(1, 31)])  # steps 1-30, then killed
    died = [{"e": "start", "t": 50.0, "launch": "y"}]  # killed before its first step: says nothing
    # Its node was lost with the restore event (steps 21-30 were done again).
    last = _launch(60.0, [(s, 60.0 + s, 1.0, 0.0) for s in range(21, 41)])
    g = analyze([first, died, last])
    assert (g.launches, g.recomputed_steps, g.recomputed) == (3, 10, 10.0)
    assert analyze([first]).recomputed_steps == 0, "no later launch: nothing known to be redone"


def test_a_step_a_sigterm_cut_short_is_recomputed_once_with_its_samples():
    """A SIGTERM's stop inside step 6 (``cut``: begun, never applied) after the save of step 5: the relaunch
    from step 5 does step 6 again. A cut whose step's end is in the log too (the step ended before the
    process did) counts once; without a later launch nothing redid it, and its time is "other"."""
    first = _launch(0.0, [(s, 10.0 + s, 1.0, 0.0) for s in range(1, 6)])  # steps 1-5, each 4 samples
    for e in first[1:]:
        e["n"] = 4
    first.append({"e": "cut", "s": 6, "t": 16.5, "d": 1.5, "f": 0.25, "n": 4})
    second = _launch(30.0, [(s, 30.0 + s, 1.0, 0.0) for s in range(6, 11)], restore=5)
    g = analyze([first, second])
    assert (g.steps, g.recomputed_steps, g.recomputed) == (10, 1, 1.5), "step 6 of launch 1 was lost"
    (t, _) = per_launch([first, second])
    assert t.recomputed_samples == 4, "the samples handed to the cut step are seen again"
    ended = [*first[:-1], {"e": "step", "s": 6, "t": 16.4, "d": 1.4, "f": 0.25, "n": 4}, first[-1]]
    assert analyze([ended, second]).recomputed_steps == 1, "a step that ended counts once, not twice"
    assert analyze([first]).recomputed_steps == 0, "no later launch: nothing known to be redone"


def test_a_second_launch_in_one_process_starts_when_its_log_opens_not_at_the_process_start(tmp_path):
    """A notebook's second ``fit``: its start-up is not the time since the process started, which the
    first launch already counted (the report showed 170 % of the wall time as start-up)."""
    storage = Storage(str(tmp_path), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    first = GoodputLog(storage, "f" * 32, flush_every_seconds=600)
    first.close()
    ended = time.time()
    second = GoodputLog(storage, "g" * 32, flush_every_seconds=600)
    second.close()
    starts = {e["launch"][0]: e["t"] for launch in read_events(storage) for e in launch if e["e"] == "start"}
    assert starts["g"] >= ended, f"the second launch starts after the first ended: {starts}"


def test_launches_that_started_in_one_second_are_read_in_start_order(tmp_path):
    """Folders are named to the second, then by launch id: a launch killed within a second of its start
    and its relaunch share the second, and the ids' order is chance (the report then had the relaunch
    first: "resumed from step 0", the first launch's steps recomputed)."""
    storage = Storage(str(tmp_path), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    first = _launch(100.2, [(1, 100.5, 0.1, 0.0), (2, 100.6, 0.1, 0.0), (3, 100.7, 0.1, 0.0)])
    relaunch = _launch(100.8, [(3, 100.95, 0.1, 0.0)], restore=2)
    for folder, events in (("20260101T000000-ffffffff", first), ("20260101T000000-aaaaaaaa", relaunch)):
        lines = "".join(json.dumps(e) + "\n" for e in events)
        storage.write_bytes(f".air-events/{folder}/rank-00000-000000.jsonl", lines.encode())
    assert [launch[0]["t"] for launch in read_events(storage)] == [100.2, 100.8]
    assert goodput_of(storage).recomputed_steps == 1, "step 3, run again after the resume from step 2"
