"""The hang watchdog: what counts as a hang (never a pause, never outside start..close), the derived limit,
the report it leaves beside the checkpoints, and the exit that nothing can stop. No timing asserts."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import platform
import re
import signal
import threading
import time
from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset

from air_core import ConfigError, procfs
from air_core.health import loader_workers as workers_module
from air_core.health.loader_workers import fork_deadlock_fix, forks_workers, loader_workers
from air_core.health.watchdog import HANG_EXIT_CODE, ExitOnHang, Hang, Watchdog, dump_stacks, restart_hazard
from air_core.session import SessionConfig, TrainingSession
from air_core.session.goodput import analyze, read_events
from air_core.session.report import measure_lines, measures
from air_core.storage import Storage
from tests.conftest import run_python
from tests.zygote import python


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watchdog(timeout: float | None = 10.0, floor: float = 300.0) -> tuple[Watchdog, Clock, list[Hang]]:
    clock, hangs = Clock(), []
    dog = Watchdog(timeout, floor_seconds=floor, on_hang=hangs.append, clock=clock)
    return dog, clock, hangs


def test_no_progress_past_the_timeout_is_a_hang_naming_the_last_step():
    dog, clock, _ = _watchdog(timeout=10.0)
    dog.arm()
    try:
        for step in range(1, 4):
            clock.now += 9.0
            dog.beat(step)
            assert dog.check() is None, "a beat within the limit restarts it"
        clock.now += 10.5
        hang = dog.check()
        assert hang is not None and hang.step == 3, f"expected a hang after step 3, got {hang}"
        assert hang.seconds == pytest.approx(10.5) and hang.limit_seconds == 10.0
    finally:
        dog.close()


def test_time_paused_in_a_save_never_counts_and_the_limit_restarts_after_it():
    dog, clock, _ = _watchdog(timeout=10.0)
    dog.arm()
    try:
        dog.beat(1)
        clock.now += 9.0
        with dog.paused():
            with dog.paused():  # nested: a flush inside a save
                clock.now += 3600.0
                assert dog.check() is None, "an hour inside a save is not a hang"
            assert dog.check() is None, "still inside the outer pause"
        clock.now += 9.0
        assert dog.check() is None, "the limit restarts when the pause ends, not at the last beat"
        clock.now += 2.0
        assert dog.check() is not None, "past the limit after the pause: a hang"
    finally:
        dog.close()


def test_never_fires_before_arm_or_after_close():
    dog, clock, _ = _watchdog(timeout=1.0)
    clock.now += 100.0
    assert dog.check() is None, "not armed: start() was not called yet"
    dog.arm()
    dog.close()
    clock.now += 100.0
    assert dog.check() is None, "closed: the launch ended"
    dog.arm()
    assert dog.check() is None, "a closed watchdog stays closed"


def test_a_launchs_first_step_gets_at_least_the_floor_whatever_the_timeout():
    """It waits for every rank's restore and start-up: a shorter limit would restart from the same commit
    forever. From the first step's end on, the timeout counts."""
    dog, clock, _ = _watchdog(timeout=3.0, floor=300.0)
    dog.arm()
    try:
        assert dog.limit_seconds() == 300.0, "before the first step ended: the floor"
        clock.now += 200.0
        dog.beat()  # an evaluation batch before any step: progress, still no step ended
        clock.now += 250.0
        assert dog.check() is None, "a first step of 450 s with progress inside it is no hang"
        clock.now += 60.0
        hang = dog.check()
        assert hang is not None and hang.step is None and hang.limit_seconds == 300.0, hang
    finally:
        dog.close()
    dog, clock, _ = _watchdog(timeout=3.0, floor=300.0)
    dog.arm()
    try:
        clock.now += 299.0
        dog.beat(1)
        assert dog.limit_seconds() == 3.0, "the first step ended: the timeout"
        clock.now += 3.5
        assert dog.check() is not None, "the second step is held to the timeout"
    finally:
        dog.close()
    dog, _, _ = _watchdog(timeout=900.0, floor=300.0)
    assert dog.limit_seconds() == 900.0, "a timeout over the floor holds from the start"


def test_derived_limit_is_ten_times_the_p99_step_time_with_a_floor():
    dog, clock, _ = _watchdog(timeout=None, floor=300.0)
    dog.arm()
    try:
        assert dog.limit_seconds() == 300.0, "before any step: the floor"
        for step in range(1, 101):
            clock.now += 1.0
            dog.beat(step)
        assert dog.limit_seconds() == 300.0, "10 x 1 s steps is under the floor"
        for step in range(101, 301):
            clock.now += 60.0
            dog.beat(step)
        assert dog.limit_seconds() == pytest.approx(600.0), "10 x the p99 of 60 s steps"
        with dog.paused():
            clock.now += 10_000.0
        clock.now += 1.0
        dog.beat(301)
        assert dog.limit_seconds() == pytest.approx(600.0), "a step with a pause in it is no step time"
        clock.now += 60.0 * 9
        dog.beat()  # an evaluation batch: progress, not a step
        clock.now += 60.0 * 9
        assert dog.check() is None, "progress other than a step restarts the limit too"
    finally:
        dog.close()


def test_a_save_grants_the_next_step_extra_time_until_that_step_ends():
    dog, clock, _ = _watchdog(timeout=10.0)
    dog.arm()
    try:
        dog.grant(100.0)  # another rank's save may hold this one in the next collective
        clock.now += 50.0
        assert dog.check() is None, "within the grant"
        dog.beat(1)
        clock.now += 11.0
        assert dog.check() is not None, "the grant ended with the step"
    finally:
        dog.close()


def test_the_watch_thread_calls_on_hang_once_and_not_while_paused():
    fired = threading.Event()
    calls: list[Hang] = []

    def on_hang(hang: Hang) -> None:
        calls.append(hang)
        fired.set()

    dog = Watchdog(0.2, on_hang=on_hang)
    dog.arm()
    try:
        with dog.paused():
            assert not fired.wait(0.6), "a paused watchdog never fires"
        dog.beat(7)
        assert fired.wait(30), "no beat for longer than the limit: the thread must fire"
        time.sleep(0.3)
        assert len(calls) == 1 and calls[0].step == 7, f"fired once, after step 7: {calls}"
    finally:
        dog.close()


def test_a_lost_peer_fires_at_once_but_not_while_paused_and_its_report_flushes_before_the_exit(caplog):
    """A peer lost (``lost`` names it) is reported within the watch thread's second however long the limit,
    never while paused (a save, a SIGTERM's flush); the report names the peer, and the saves in flight
    are flushed before the exit, which a hang's is not."""
    lost, hangs = [""], []
    dog = Watchdog(600.0, on_hang=hangs.append, clock=Clock(), lost=lambda: lost[0])
    dog.arm()
    try:
        dog.beat(4)
        assert dog.check() is None, "nothing lost, no hang"
        lost[0] = "rank 3 (pid 12 on host b)"
        with dog.paused():
            assert dog.check() is None, "paused: a flush or a save under way goes on"
        hang = dog.check()
        assert hang is not None and hang.lost == lost[0] and hang.step == 4, hang
    finally:
        dog.close()
    done: list[str] = []
    handler = ExitOnHang(who="Test", rank=0, launch_id="L" * 32, flush=lambda: done.append("flush"),
                         exit=lambda code: done.append(f"exit {code}"))  # fmt: skip
    with caplog.at_level(logging.ERROR, logger="air_core.health.watchdog"):
        handler(hang)
        handler(dataclasses.replace(hang, lost=""))
    assert done == ["flush", f"exit {HANG_EXIT_CODE}", f"exit {HANG_EXIT_CODE}"], "a hang flushes nothing"
    lost_line, hang_line = (r.getMessage().split("\n", 1)[0] for r in caplog.records)
    assert "rank 0 on" in lost_line and "lost rank 3 (pid 12 on host b)" in lost_line, lost_line
    assert "made no progress" in hang_line and "lost" not in hang_line, hang_line


def _sleeping_in_a_training_step(stop: threading.Event) -> None:
    stop.wait(60)


def test_exit_on_hang_leaves_the_stacks_and_a_record_beside_the_checkpoints_then_exits(tmp_path):
    storage = Storage(str(tmp_path), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    stop = threading.Event()
    sleeper = threading.Thread(target=_sleeping_in_a_training_step, args=(stop,))
    sleeper.start()
    exits, records = [], []
    try:
        handler = ExitOnHang(
            who="Test",
            rank=1,
            launch_id="L" * 32,
            write=storage.write_bytes,
            record=records.append,
            exit=exits.append,
        )
        handler(Hang(12.5, 10.0, 41, time.time(), sleeper.ident))
    finally:
        stop.set()
        sleeper.join()
    assert exits == [HANG_EXIT_CODE], "the handler ends the process with the hang exit code"
    stacks = storage.read_bytes(f".air-events/hang-{'L' * 32}-rank00001.txt").decode()
    assert "_sleeping_in_a_training_step" in stacks, "every thread's stack, the hung one included"
    assert f"0x{sleeper.ident:016x}" in stacks, "the header names the training thread as faulthandler does"
    record = json.loads(storage.read_bytes(f".air-events/hang-{'L' * 32}-rank00001.json"))
    assert (record["rank"], record["s"], record["since"]) == (1, 41, 12.5), record
    assert records == [record], "rank 0's goodput log gets the same record"


class _SlowSample(Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        time.sleep(5)
        return i


def test_a_hang_in_a_dataloader_fetch_says_what_can_keep_it_there(caplog):
    """A loader worker that cannot pass a batch through a full /dev/shm drops it and the training thread
    waits for ever without an error: the hang report says so when that thread waits in a loader."""
    got: list[int] = []
    fetching = threading.Thread(target=lambda: got.extend(DataLoader(_SlowSample(), num_workers=1)))
    fetching.start()
    deadline = time.monotonic() + 4
    while "_try_get_data" not in dump_stacks() and time.monotonic() < deadline:
        time.sleep(0.05)
    exits: list[int] = []
    with caplog.at_level(logging.ERROR, logger="air_core.health.watchdog"):
        ExitOnHang(who="Test", rank=0, launch_id="x" * 32, exit=exits.append)(
            Hang(12.5, 10.0, 3, time.time(), fetching.ident)
        )
        ExitOnHang(who="Test", rank=0, launch_id="x" * 32, exit=exits.append)(
            Hang(12.5, 10.0, 3, time.time(), threading.get_ident())
        )
    fetching.join()
    assert got == [0] and exits == [HANG_EXIT_CODE] * 2
    fetch, other = [r.getMessage().split("\n", 1)[0] for r in caplog.records]
    assert "It waits in a DataLoader for a batch" in fetch and "/dev/shm" in fetch, fetch
    # the worker sleeps in time.sleep, or is still starting
    assert re.search(r"Its loader workers: \d+ (running|state \w[^.]*), [0-9.]+ s CPU\.", fetch), fetch
    assert "forkserver" not in fetch, "a sleeping worker is not taken for one stuck on a lock"
    assert "DataLoader" not in other, "a thread elsewhere: no such line"


_HELD_AT_FORK = threading.Lock()


class _Locked(Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        with _HELD_AT_FORK:  # taken in the parent when the worker was forked: never free in the worker
            return i


def _fetch_until_the_timeout(iterator: Any) -> None:
    with contextlib.suppress(RuntimeError):  # "DataLoader timed out"
        next(iterator)


def _end_stuck_workers(iterator: Any) -> None:
    """Kill ``iterator``'s workers (stuck for good: its shutdown would wait 5 s for each first) with
    SIGCHLD held back until it forgot them, or torch's SIGCHLD handler raises in this thread."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        for process in iterator._workers:
            process.kill()
            process.join()
        iterator._shutdown_workers()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})


def _asleep_and_waited_for(iterator: Any) -> tuple[Any, threading.Thread]:
    """Once ``iterator``'s one worker sleeps on a lock: its ``WorkerState``, and a thread waiting in the
    loader for its batch (until the loader's timeout)."""
    (process,) = iterator._workers
    deadline = time.monotonic() + 30
    while not (asleep := [w for w in loader_workers() if w.pid == process.pid and w.syscall == "futex"]):
        assert time.monotonic() < deadline, f"the worker never waited on the lock: {loader_workers()}"
        time.sleep(0.05)
    fetching = threading.Thread(target=_fetch_until_the_timeout, args=(iterator,))
    fetching.start()
    while "_try_get_data" not in dump_stacks():
        assert time.monotonic() < deadline, "the thread never waited for the batch"
        time.sleep(0.05)
    return asleep[0], fetching


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="futex's number not known")
def test_a_loader_worker_stuck_on_a_lock_held_at_its_fork_is_named_with_the_fix(caplog):
    """What hung this suite's loaders: a worker forked while another thread held a lock waits forever."""
    with _HELD_AT_FORK:
        iterator = iter(DataLoader(_Locked(), num_workers=1, timeout=5))
    try:
        worker, fetching = _asleep_and_waited_for(iterator)
        assert str(worker.pid) in "".join(w.describe() for w in loader_workers())
        with caplog.at_level(logging.ERROR, logger="air_core.health.watchdog"):
            ExitOnHang(who="Test", rank=0, launch_id="x" * 32, exit=lambda code: None)(
                Hang(12.5, 10.0, 3, time.time(), fetching.ident)
            )
        header = caplog.records[0].getMessage().split("\n", 1)[0]
        assert f"Its loader workers: {worker.pid} asleep on a lock (futex)" in header, header
        assert "multiprocessing_context='forkserver'" in header, "the fix is named"
        fetching.join()
    finally:
        _end_stuck_workers(iterator)


_STUCK_IN_FORK = threading.Event()


def _stay_in_fork() -> None:
    """As CPython gh-112275 leaves a forked child: asleep on a lock before any code of its own ran."""
    if _STUCK_IN_FORK.is_set():
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()


os.register_at_fork(after_in_child=_stay_in_fork)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="futex's number not known")
def test_a_worker_stuck_inside_its_fork_is_named_with_the_python_release_that_fixes_it(caplog, monkeypatch):
    """Such a worker keeps the training process's name (it never became ``pt_data_worker``): the report
    lists it, and on a Python with gh-112275 names the release to upgrade to."""
    _STUCK_IN_FORK.set()
    try:
        iterator = iter(DataLoader(range(4), num_workers=1, timeout=5, multiprocessing_context="fork"))
    finally:
        _STUCK_IN_FORK.clear()
    try:
        worker, fetching = _asleep_and_waited_for(iterator)
        assert not worker.started and "before its loop started" in worker.describe(), worker
        headers = []
        for fix in ("3.10.15", None):
            monkeypatch.setattr(workers_module, "fork_deadlock_fix", lambda fix=fix: fix)
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="air_core.health.watchdog"):
                ExitOnHang(who="Test", rank=0, launch_id="x" * 32, exit=lambda code: None)(
                    Hang(12.5, 10.0, 3, time.time(), fetching.ident)
                )
            headers.append(caplog.records[0].getMessage().split("\n", 1)[0])
        affected, fixed = headers
        assert f"{worker.pid} asleep on a lock (futex) before its loop started" in affected, affected
        assert "gh-112275" in affected and "Use Python 3.10.15 or later" in affected, affected
        assert "gh-112275" not in fixed and "multiprocessing_context='forkserver'" in fixed, fixed
        fetching.join()
    finally:
        _end_stuck_workers(iterator)


def _threads_then_sleep() -> None:
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    time.sleep(60)


def test_a_forked_child_that_started_threads_of_its_own_is_no_loader_worker():
    """A copy of the training process that runs (a rank ``ddp_fork`` started, a pool's worker with
    threads) is not taken for a loader worker stuck in its fork: that one has the forking thread only."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=_threads_then_sleep, daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 30
        while (read := procfs.stat(child.pid)) is None or read[1][procfs.THREADS] != "2":
            assert time.monotonic() < deadline, f"the child never started its thread: {read}"
            time.sleep(0.05)
        assert child.pid not in [w.pid for w in loader_workers()], loader_workers()
    finally:
        child.kill()
        child.join()


def test_gh_112275_is_named_for_the_pythons_that_have_it_once_per_process_for_forked_workers(
    caplog, monkeypatch
):
    assert fork_deadlock_fix((3, 10, 13)) == "3.10.15" and fork_deadlock_fix((3, 11, 7)) == "3.11.10"
    assert fork_deadlock_fix((3, 10, 15)) is None and fork_deadlock_fix((3, 11, 10)) is None
    assert fork_deadlock_fix((3, 12, 0)) is None and fork_deadlock_fix((3, 13, 0)) is None
    assert forks_workers(DataLoader(range(4), num_workers=2, multiprocessing_context="fork"))
    assert not forks_workers(DataLoader(range(4), num_workers=2, multiprocessing_context="forkserver"))
    assert not forks_workers(DataLoader(range(4))), "no workers, no fork"
    monkeypatch.setattr(workers_module, "fork_deadlock_fix", lambda: "3.10.15")
    monkeypatch.setattr(workers_module, "_warned", False)
    session = TrainingSession(SessionConfig(mlflow=False, owner="AirPlugin"))
    with caplog.at_level(logging.WARNING, logger="air_core.health.loader_workers"):
        session.positions.track(DataLoader(range(4), num_workers=2, multiprocessing_context="forkserver"),
                                epoch=lambda: 0)  # fmt: skip
        assert not caplog.records, "workers started without fork cannot deadlock in it"
        for _ in range(2):
            session.positions.track(DataLoader(range(4), num_workers=2, multiprocessing_context="fork"),
                                    epoch=lambda: 0)  # fmt: skip
    (warning,) = caplog.records
    text = warning.getMessage()
    assert text.startswith("AirPlugin: this Python") and "gh-112275" in text, text
    assert "Use Python 3.10.15 or later" in text and "multiprocessing_context='forkserver'" in text, text


def test_exit_on_hang_exits_even_when_the_storage_hangs():
    stuck = threading.Event()
    exits: list[int] = []

    def write(path: str, data: bytes) -> None:
        stuck.wait(30)

    handler = ExitOnHang(
        who="Test", rank=0, launch_id="x" * 32, write=write, report_timeout_seconds=0.3, exit=exits.append
    )
    handler(Hang(5.0, 1.0, None, time.time(), None))
    stuck.set()
    assert exits == [HANG_EXIT_CODE], "a stuck report must not stop the exit"


def test_a_restart_through_a_shared_rendezvous_store_is_warned_about():
    shared = {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in (restart_hazard(shared) or ""), "the fix is named"
    own = {**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert restart_hazard(own) is None, "each attempt has its own store"
    assert restart_hazard({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None, "no restart, no hazard"


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"hang_timeout_seconds": 0}, "hang_timeout_seconds=0): must be a number of seconds > 0"),
        ({"hang_floor_seconds": -1.0}, "hang_floor_seconds=-1.0): must be a number of seconds > 0"),
        ({"hang_watchdog": "yes"}, "hang_watchdog='yes'): must be True, False or None"),
    ],
)
def test_hang_settings_are_checked_naming_the_argument(kwargs, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        SessionConfig(owner="AirPlugin", **kwargs)


def test_a_hang_is_its_own_badput_line_and_a_logless_launch_still_counts(tmp_path):
    storage = Storage(str(tmp_path), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    first = [{"e": "start", "t": 0.0, "launch": "a" * 32}]
    first += [{"e": "step", "s": s, "t": float(s), "d": 1.0, "f": 0.0} for s in (1, 2, 3)]
    storage.write_bytes(".air-events/19700101T000000-aaaaaaaa/rank-00000-000000.jsonl", _jsonl(first))
    second = [
        {"e": "start", "t": 40.0, "launch": "c" * 32},
        {"e": "restore", "s": 2, "t": 41.0, "seconds": 1.0},
    ]
    second += [{"e": "step", "s": 3, "t": 43.0, "d": 1.0, "f": 0.0}, {"e": "end", "t": 44.0}]
    storage.write_bytes(".air-events/19700101T000040-cccccccc/rank-00000-000000.jsonl", _jsonl(second))
    # Launch a: rank 1 hung after step 3 (10 s); launch b hung before its log's first segment.
    hang_a = {"e": "hang", "launch": "a" * 32, "rank": 1, "host": "h", "s": 3, "t": 13.0, "since": 10.0}
    hang_b = {"e": "hang", "launch": "b" * 32, "rank": 0, "host": "h", "s": None, "t": 30.0, "since": 8.0}
    for hang in (hang_a, hang_b):
        path = f".air-events/hang-{hang['launch']}-rank{hang['rank']:05d}.json"
        storage.write_bytes(path, json.dumps(hang).encode())
    launches = read_events(storage)
    assert [ls[0]["launch"][0] for ls in launches] == ["a", "b", "c"], "launches in start order"
    g = analyze(launches)
    assert (g.hang_count, g.hangs) == (2, 18.0), f"both hangs, 10 s + 8 s: {g}"
    assert "lost to hangs (2)" in g.report() and g.as_metrics()["goodput_hangs_seconds"] == 18.0
    parts = g.productive + g.checkpoint_stalls + g.data_waits + g.startup + g.restore + g.recomputed
    assert parts + g.hangs + g.other == pytest.approx(g.wall), "the hang is carved out of the wall time"


def test_a_rank_stopped_for_a_lost_peer_is_reported_as_such_and_not_as_a_hang(tmp_path):
    storage = Storage(str(tmp_path), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    events = [{"e": "start", "t": 0.0, "launch": "a" * 32}]
    events += [{"e": "step", "s": s, "t": float(s), "d": 1.0, "f": 0.0} for s in (1, 2, 3)]
    storage.write_bytes(".air-events/19700101T000000-aaaaaaaa/rank-00000-000000.jsonl", _jsonl(events))
    stop = {"e": "hang", "launch": "a" * 32, "rank": 0, "host": "h", "s": 3, "t": 4.5, "since": 1.5}
    stop |= {"limit": 300.0, "lost": "rank 1 (pid 7 on host b)"}
    storage.write_bytes(f".air-events/hang-{'a' * 32}-rank00000.json", json.dumps(stop).encode())
    launches = read_events(storage)
    g = analyze(launches)
    assert (g.hang_count, g.hangs) == (0, 0.0), f"no hang: {g}"
    measured = measures(launches)
    assert measured["hangs"] == [] and [s["lost"] for s in measured["lost_peers"]] == [stop["lost"]]
    line = measure_lines(measured)[-1]
    assert line.startswith("stopped (launch 1): rank 0 on h after step 3, having lost rank 1"), line


def _jsonl(events: list[dict]) -> bytes:
    return "".join(json.dumps(e) + "\n" for e in events).encode()


_SESSION_HANG = """
import sys, time
from air_core.session import SessionConfig, TrainingSession

def sleep_forever_inside_a_step():
    while True:
        time.sleep(1)

config = SessionConfig(hang_watchdog=True, hang_timeout_seconds=1.0, mlflow=False)
session = TrainingSession(config, rank=0, world_size=1)
session.open(sys.argv[1])
session.start()
for step in range(1, 4):
    session.record_step(step)
with session.watchdog_paused():
    time.sleep(2.5)  # a restore, say: never a hang
session.save({"w.pt": {"step": 3}}, step=3, name="step-3").result()
session.record_step(4)
print("sleeping", flush=True)
sleep_forever_inside_a_step()
"""


def test_a_session_that_stops_making_progress_dumps_its_stacks_and_exits_87(tmp_path):
    out = run_python(_SESSION_HANG, str(tmp_path), timeout=120, interpreter=python())
    assert out.returncode == HANG_EXIT_CODE, (
        f"expected exit {HANG_EXIT_CODE}: {out.returncode}\n{out.stderr[-3000:]}"
    )
    assert "sleeping" in out.stdout, "the paused time and the save did not count as a hang"
    assert "sleep_forever_inside_a_step" in out.stderr, "the stacks go to the log (stderr)"
    stacks = list((tmp_path / ".air-events").glob("hang-*-rank00000.txt"))
    assert stacks and "sleep_forever_inside_a_step" in stacks[0].read_text(), "and beside the checkpoints"
    g = analyze(read_events(Storage(str(tmp_path), storage_options={}, retries=0, retry_backoff_seconds=0.0)))
    assert (g.hang_count, g.steps) == (1, 4), f"rank 0's log was written up to the hang: {g}"
