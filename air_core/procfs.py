"""A process's ``/proc/<pid>/stat`` (Linux), read in one place: its command name may hold spaces and
parentheses, so the fields are those after its last ``)``."""

from __future__ import annotations

STATE, PARENT, USER_TICKS, SYSTEM_TICKS, START_TICKS = 0, 1, 11, 12, 19
"""Indexes into ``stat``'s fields: state (``R``, ``S``, ...), parent pid, user and system CPU time and the
start time after boot (clock ticks)."""


def stat(pid: int | str = "self") -> tuple[str, list[str]] | None:
    """(command name, the fields after it) of process ``pid``; None where it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            line = f.read()
    except OSError:
        return None
    head, _, tail = line.rpartition(")")
    return head.partition("(")[2], tail.split()
