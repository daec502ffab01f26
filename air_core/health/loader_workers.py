"""What this process's DataLoader workers are doing, read from ``/proc`` (Linux), for the hang report.

A worker is forked from the training process. When another thread of it held a lock at that moment
(``torch.manual_seed``'s lazy-call lock, a module's import lock, a C library's), the worker starts with
that lock taken by a thread it does not have: it waits for it forever, asleep in ``futex`` with no CPU,
and its loader waits forever for the batch. A slow worker runs, or sleeps in its own I/O. PyTorch names
its workers ``pt_data_worker``.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from .. import procfs

WORKER_NAME = "pt_data_worker"
_FUTEX = {"x86_64": 202, "aarch64": 98, "riscv64": 98}.get(platform.machine())
"""The ``futex`` system call's number on this machine (``/proc/<pid>/syscall`` gives numbers)."""
FORK_HINT = (
    "A worker asleep on a lock with next to no CPU may wait for one that another thread of this process "
    "held when the worker was forked, and will never wake: start the workers with "
    "DataLoader(multiprocessing_context='forkserver') or 'spawn'."
)


@dataclass(frozen=True)
class WorkerState:
    pid: int
    state: str
    """``/proc``'s: ``R`` running, ``S`` asleep, ``D`` in uninterruptible I/O, ``Z`` exited, ..."""
    syscall: str
    """The call it sleeps in: ``futex`` (a lock), another call's number, ``running``, or ``""``
    (unreadable)."""
    cpu_seconds: float

    def describe(self) -> str:
        if self.syscall == "futex":
            doing = "asleep on a lock (futex)"
        elif self.state == "R" or self.syscall == "running":
            doing = "running"
        else:
            doing = f"state {self.state}" + (f", in system call {self.syscall}" if self.syscall else "")
        return f"{self.pid} {doing}, {self.cpu_seconds:.2f} s CPU"


def loader_workers(parent: int | None = None) -> list[WorkerState]:
    """The DataLoader workers whose parent is ``parent`` (default: this process), in pid order; empty
    where ``/proc`` cannot be read."""
    parent = os.getpid() if parent is None else parent
    ticks = os.sysconf("SC_CLK_TCK")
    found = []
    try:
        pids = sorted(int(n) for n in os.listdir("/proc") if n.isdigit())
    except OSError:
        return []
    for pid in pids:
        read = procfs.stat(pid)
        if read is None:  # gone meanwhile
            continue
        name, fields = read
        if name != WORKER_NAME or int(fields[procfs.PARENT]) != parent:
            continue
        cpu = (int(fields[procfs.USER_TICKS]) + int(fields[procfs.SYSTEM_TICKS])) / ticks
        found.append(WorkerState(pid, fields[procfs.STATE], _syscall(pid), cpu))
    return found


def _syscall(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/syscall") as f:
            first = f.read().split(maxsplit=1)[0]
    except (OSError, IndexError):  # another user's process, or a kernel without it
        return ""
    return "futex" if _FUTEX is not None and first == str(_FUTEX) else first
