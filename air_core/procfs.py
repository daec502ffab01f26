"""A process's ``/proc/<pid>/stat`` (Linux), read in one place: its command name may hold spaces and
parentheses, so the fields are those after its last ``)``. And ``Process``: who wrote a record (the
root's lease, a save's part), so that a process on the same host can tell whether the writer lives, and
a rank of the job (``CheckpointerConfig.peers``), whose death its peers on other hosts see through its
``beacon``."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from . import liveness

STATE, PARENT, USER_TICKS, SYSTEM_TICKS, THREADS, START_TICKS = 0, 1, 11, 12, 17, 19
"""Indexes into ``stat``'s fields: state (``R``, ``S``, ...), parent pid, user and system CPU time, the
number of threads and the start time after boot (clock ticks)."""


def stat(pid: int | str = "self") -> tuple[str, list[str]] | None:
    """(command name, the fields after it) of process ``pid``; None where it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            line = f.read()
    except OSError:
        return None
    head, _, tail = line.rpartition(")")
    return head.partition("(")[2], tail.split()


def started(pid: int | str = "self") -> str:
    """The process's start time after boot as /proc says it (tells a process from a later one given the
    same pid); "" where it is gone or there is no /proc."""
    read = stat(pid)
    return read[1][START_TICKS] if read is not None and len(read[1]) > START_TICKS else ""


def pid_space() -> str:
    """Where a pid names one process: this kernel boot and pid namespace (containers on one host may share
    its host name, or not its pids), and ``AIR_NODE_NAME`` where set (a "node" of its own, as the tests
    run several on one host); "" where /proc does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        space = f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""
    node = os.environ.get("AIR_NODE_NAME")
    return f"{space}/{node}" if node else space


@dataclass(frozen=True)
class Process:
    """A process as a record names it: its host, pid, start time (``started``) and ``pid_space``."""

    host: str
    pid: int
    started: str
    space: str = ""
    """Its ``pid_space``; "" in records that do not say (the root's lease): the host name stands for it."""
    beacon: str = ""
    """Where it answers watchers (``liveness.serve``: ``"host:port"``), "" where it does not."""

    @classmethod
    def this(cls) -> Process:
        return cls(socket.gethostname(), os.getpid(), started(), pid_space(), liveness.address())

    @property
    def hello(self) -> str:
        """What its beacon says to a watcher: a later process at that address says something else."""
        return f"air {self.pid} {self.started} {self.space}\n"

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}"

    def gone(self) -> bool:
        """Whether it has certainly ended: its pid names processes here (the same ``space``) and no process
        has that pid and start time, or it is a zombie (dead; a launcher that never polls its children
        leaves it unreaped); elsewhere, its ``beacon`` was watched from here (``liveness.watch``) and the
        watch has closed. False where that cannot be told (no beacon, or not watched)."""
        here = self.space == pid_space() if self.space else self.host == socket.gethostname()
        if not here:
            return bool(self.beacon) and liveness.closed(self.beacon, self.hello)
        if self.pid <= 0:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # it exists, owned by another user
        read = stat(self.pid)
        if read is None or len(read[1]) <= START_TICKS:
            return False  # no /proc, or it ended this instant: the next look tells
        if self.started and read[1][START_TICKS] != self.started:
            return True  # a later process has its pid
        return read[1][STATE] in ("Z", "X")

    def lost(self) -> bool:
        """Whether, on another host and watched from here, it ended without ending its training well
        (``liveness.farewell``): killed, crashed, or its host gone. The job cannot go on without it."""
        return bool(self.beacon) and liveness.lost(self.beacon, self.hello)
