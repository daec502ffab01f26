"""``liveness``: a process on another "host" (``AIR_NODE_NAME``: its pids mean nothing here) is seen dead
through the beacon it serves, as soon as it dies, and only a beacon that answered as that process counts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from air_core import liveness, procfs
from tests.conftest import REPO

# Serves its beacon and prints its Process; at a line on stdin (once watched) forks a child that outlives
# it by 30 s (a loader worker, forked with the watch's connection open) and prints the child's pid.
_PEER = """
import dataclasses, json, os, sys, time
from air_core import liveness, procfs
liveness.serve(procfs.Process.this().hello, toward="127.0.0.1", limit=4)
print(json.dumps(dataclasses.asdict(procfs.Process.this())), flush=True)
sys.stdin.readline()
parent = os.getpid()
child = os.fork()
if child == 0:
    while os.getppid() == parent:
        time.sleep(0.05)
    time.sleep(30)
    os._exit(0)
print(child, flush=True)
time.sleep(60)
"""


def _peer(node: str = "elsewhere") -> tuple[subprocess.Popen, procfs.Process]:
    """A process of another "host"."""
    env = {**os.environ, "PYTHONPATH": REPO, "AIR_NODE_NAME": node}
    pipe = subprocess.PIPE
    proc = subprocess.Popen([sys.executable, "-c", _PEER], stdin=pipe, stdout=pipe, text=True, env=env)
    assert proc.stdout is not None
    return proc, procfs.Process(**json.loads(proc.stdout.readline()))


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_watched_process_on_another_host_is_gone_once_it_dies_though_its_forked_child_lives():
    proc, peer = _peer()
    child = 0
    try:
        assert peer.space != procfs.pid_space() and peer.beacon.startswith("127.0.0.1:")
        liveness.watch([(peer.beacon, peer.hello)])
        _until(lambda: liveness._watches[(peer.beacon, peer.hello.encode())].sock is not None, "watched")
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("fork\n")
        proc.stdin.flush()
        child = int(proc.stdout.readline())
        time.sleep(0.2)
        assert not peer.gone(), "it lives"
        os.kill(proc.pid, signal.SIGKILL)
        _until(peer.gone, "the watch saw the death (the child closed its copies of the beacon's sockets)")
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
