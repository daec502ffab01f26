"""``liveness``: a process on another "host" (``AIR_NODE_NAME``: its pids mean nothing here) is seen dead
through the beacon it serves, as soon as it dies, and only a beacon that answered as that process counts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from air_core import liveness, procfs
from tests.conftest import REPO

# Serves its beacon and prints its Process, then acts on each line of stdin, answering "ok": "fork" forks
# a child that outlives it by 30 s (a loader worker, forked with the watches' connections open) and
# answers its pid; "farewell" says it ended its training well; "serve" serves again (a later session);
# "exit" exits as a script ends (atexit runs), "raise" with an uncaught exception.
_PEER = """
import dataclasses, json, os, sys, time
from air_core import liveness, procfs
me = procfs.Process.this()
liveness.serve(me.hello, toward=os.environ["TOWARD"], limit=4)
print(json.dumps(dataclasses.asdict(procfs.Process.this())), flush=True)
for line in sys.stdin:
    line = line.strip()
    if line == "fork":
        parent = os.getpid()
        child = os.fork()
        if child == 0:
            while os.getppid() == parent:
                time.sleep(0.05)
            time.sleep(30)
            os._exit(0)
        print(child, flush=True)
        continue
    if line == "farewell":
        liveness.farewell()
    elif line == "serve":
        liveness.serve(me.hello, toward=os.environ["TOWARD"], limit=4)
    elif line in ("exit", "raise"):
        print("ok", flush=True)
        time.sleep(0.2)
        if line == "raise":
            raise RuntimeError("a rank crashed")
        sys.exit(0)
    print("ok", flush=True)
"""


def _peer(node: str = "elsewhere", toward: str = "127.0.0.1") -> tuple[subprocess.Popen, procfs.Process]:
    """A process of another "host", its beacon on the route to ``toward`` (its ``MASTER_ADDR``)."""
    env = {**os.environ, "PYTHONPATH": REPO, "AIR_NODE_NAME": node, "TOWARD": toward}
    pipe = subprocess.PIPE
    proc = subprocess.Popen([sys.executable, "-c", _PEER], stdin=pipe, stdout=pipe, text=True, env=env)
    assert proc.stdout is not None
    return proc, procfs.Process(**json.loads(proc.stdout.readline()))


def _say(proc: subprocess.Popen, line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def _watched(peer: procfs.Process) -> None:
    liveness.watch([(peer.beacon, peer.hello)])
    _until(lambda: liveness._watches[(peer.beacon, peer.hello.encode())].sock is not None, "watched")


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("toward", ["127.0.0.1", "::1"], ids=["ipv4", "ipv6"])
def test_a_watched_process_on_another_host_is_gone_once_it_dies_though_its_forked_child_lives(toward):
    proc, peer = _peer(toward=toward)
    child = 0
    try:
        assert peer.space != procfs.pid_space() and peer.beacon.startswith(f"{toward}:")
        _watched(peer)
        child = int(_say(proc, "fork"))
        time.sleep(0.2)
        assert not peer.gone() and not peer.lost(), "it lives"
        os.kill(proc.pid, signal.SIGKILL)
        _until(peer.gone, "the watch saw the death (the child closed its copies of the beacon's sockets)")
        assert peer.lost(), "killed: its training did not end well"
        assert procfs.stat(child)[1][procfs.STATE] not in ("Z", "X"), "the child still runs"
    finally:
        proc.kill()
        proc.wait()
        if child:
            os.kill(child, signal.SIGKILL)


def test_a_process_not_watched_or_answered_by_another_is_never_called_gone():
    proc, peer = _peer()
    other, stranger = _peer("another")
    try:
        posing = procfs.Process(peer.host, peer.pid, peer.started, peer.space, beacon=stranger.beacon)
        liveness.watch([(posing.beacon, posing.hello)])  # the stranger's hello is not the peer's
        unwatched = procfs.Process(stranger.host, stranger.pid, stranger.started, stranger.space, "")
        time.sleep(0.5)
        os.kill(other.pid, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
        time.sleep(0.5)
        assert not posing.gone(), "another process answered there: its watch was never made"
        assert not unwatched.gone() and not peer.gone(), "never watched from here"
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()


def test_a_process_that_ended_its_training_well_is_gone_but_not_lost():
    """A farewell (a session closed without a failure, or a script's normal end) makes its end no loss;
    serving again (its next session) makes a death a loss again; an uncaught exception says no farewell."""
    ends = {}
    for how in ("farewell", "exit", "again", "raise"):
        proc, peer = _peer(f"node-{how}")
        try:
            _watched(peer)
            if how in ("farewell", "again"):
                assert _say(proc, "farewell") == "ok"
            if how == "again":
                assert _say(proc, "serve") == "ok"
            if how in ("exit", "raise"):
                assert _say(proc, how) == "ok"
                proc.wait(timeout=30)
            else:
                time.sleep(0.2)  # the words reach the watch before the death
                os.kill(proc.pid, signal.SIGKILL)
            _until(peer.gone, f"{how}: the watch saw the end")
            ends[how] = peer.lost()
        finally:
            proc.kill()
            proc.wait()
    assert ends == {"farewell": False, "exit": False, "again": True, "raise": True}, ends


def test_a_session_names_the_watched_peer_it_lost(tmp_path):
    """What the session's watchdog asks once a second: a peer on another host, watched, killed."""
    from air_core.session import SessionConfig, TrainingSession

    session = TrainingSession(SessionConfig(mlflow=False, preflight=False), rank=0, world_size=1)
    proc, peer = _peer()
    try:
        _watched(peer)
        session.peers = (procfs.Process.this(), peer)
        assert session._lost_peer() == ""
        os.kill(proc.pid, signal.SIGKILL)
        _until(peer.gone, "the watch saw the death")
        assert session._lost_peer() == f"rank 1 ({peer.describe()})"
    finally:
        proc.kill()
        proc.wait()
        session.close(0)
