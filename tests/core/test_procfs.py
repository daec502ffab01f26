"""``procfs.Process``: a record's writer is known dead only where its pid names processes here."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

from air_core import procfs


def _ended() -> procfs.Process:
    """A process of this host that has ended (its pid not reused yet: nothing forks in between)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        process = dataclasses.replace(procfs.Process.this(), pid=proc.pid, started=procfs.started(proc.pid))
    finally:
        proc.kill()
        proc.wait()
    return process


def test_a_process_of_this_host_that_ended_is_gone_and_a_live_one_is_not():
    assert not procfs.Process.this().gone()
    ended = _ended()
    assert ended.started and ended.space == procfs.pid_space() != ""
    assert ended.gone()


def test_a_live_pid_with_another_start_time_is_a_later_process_and_the_one_named_is_gone():
    me = procfs.Process.this()
    assert dataclasses.replace(me, started=str(int(me.started) - 1)).gone()
    assert not dataclasses.replace(me, started="").gone(), "no start time: the pid's process is taken as it"


def test_a_process_whose_pids_are_not_this_process_s_is_never_called_gone():
    ended = _ended()
    assert not dataclasses.replace(ended, space="another-boot/pid:[1]").gone(), "another container or boot"
    assert not dataclasses.replace(ended, host="another-host", space="").gone(), "a record without a space"
    assert dataclasses.replace(ended, space="").gone(), "without a space, the host name stands for it"
    assert not dataclasses.replace(ended, pid=0).gone(), "a record of an earlier version names no pid"


def test_a_killed_child_its_parent_has_not_reaped_is_gone():
    """A zombie still answers ``kill(pid, 0)``: a launcher that never polls its children leaves one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        child = dataclasses.replace(procfs.Process.this(), pid=proc.pid, started=procfs.started(proc.pid))
        assert not child.gone()
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while procfs.stat(proc.pid)[1][procfs.STATE] != "Z":  # not waited for: a zombie
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.01)
        assert child.gone()
    finally:
        proc.kill()
        proc.wait()
