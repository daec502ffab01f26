"""What this process's DataLoader workers are doing, read from ``/proc`` (Linux), for the hang report, and
whether this Python can deadlock one at its fork.

A worker is forked from the training process. When another thread of it held a lock at that moment
(``torch.manual_seed``'s lazy-call lock, a module's import lock, a C library's), the worker starts with
that lock taken by a thread it does not have: it waits for it forever, asleep in ``futex`` with no CPU,
and its loader waits forever for the batch. A slow worker runs, or sleeps in its own I/O. PyTorch names
its workers ``pt_data_worker`` when their loop starts; one stuck before that still has the training
process's name and command line.

CPython before 3.10.15 and 3.11.10 deadlocks a forked child inside ``fork`` itself (gh-112275): the
interpreter's thread-state lock, taken without the GIL by a C++ thread that enters Python (gloo's and
NCCL's threads do, to free the tensors of each finished collective), stays taken in the child. Seen in
this suite on 3.10.13: about one two-rank gloo job with loader workers in twenty hung this way.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader

from .. import procfs

logger = logging.getLogger(__name__)

WORKER_NAME = "pt_data_worker"
_FORK_DEADLOCK_FIXED = {(3, 10): (3, 10, 15), (3, 11): (3, 11, 10)}
"""The release of each CPython line that fixed gh-112275 (earlier lines are not supported)."""
_FUTEX = {"x86_64": 202, "aarch64": 98, "riscv64": 98}.get(platform.machine())
"""The ``futex`` system call's number on this machine (``/proc/<pid>/syscall`` gives numbers)."""
FORK_HINT = (
    "A worker asleep on a lock with next to no CPU may wait for one that another thread of this process "
    "held when the worker was forked, and will never wake: start the workers with "
    "DataLoader(multiprocessing_context='forkserver') or 'spawn'."
)


def fork_deadlock_fix(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> str | None:
    """The CPython release that fixes gh-112275 for ``version`` (default: this Python), e.g. "3.10.15";
    None where ``version`` has the fix."""
    fixed = _FORK_DEADLOCK_FIXED.get((version[0], version[1]))
    return None if fixed is None or tuple(version[:3]) >= fixed else ".".join(map(str, fixed))


def forks_workers(loader: Any) -> bool:
    """Whether ``loader`` is a ``DataLoader`` whose workers are started by ``fork``."""
    if not isinstance(loader, DataLoader) or loader.num_workers == 0:
        return False
    context = loader.multiprocessing_context
    if context is not None:
        return bool(context.get_start_method() == "fork")
    chosen = multiprocessing.get_start_method(allow_none=True)  # the default is the first listed
    return (chosen or multiprocessing.get_all_start_methods()[0]) == "fork"


def warn_of_fork_deadlock(loader: Any, owner: str) -> None:
    """Log once per process when ``loader`` forks its workers on a Python with gh-112275."""
    global _warned
    fix = fork_deadlock_fix()
    if fix is None or _warned or not forks_workers(loader):
        return
    _warned = True
    logger.warning(
        "%s: this Python (%s) can deadlock a DataLoader worker inside its fork (CPython gh-112275): "
        "a collective's thread that enters Python as the worker is forked leaves it asleep for good, and "
        "its loader waits forever for the batch (under torchrun the hang watchdog restarts the job after "
        "its limit). Use Python %s or later, or DataLoader(multiprocessing_context='forkserver').",
        owner,
        platform.python_version(),
        fix,
    )


_warned = False
"""Whether ``warn_of_fork_deadlock`` warned in this process."""


@dataclass(frozen=True)
class WorkerState:
    pid: int
    state: str
    """``/proc``'s: ``R`` running, ``S`` asleep, ``D`` in uninterruptible I/O, ``Z`` exited, ..."""
    syscall: str
    """The call it sleeps in: ``futex`` (a lock), another call's number, ``running``, or ``""``
    (unreadable)."""
    cpu_seconds: float
    started: bool = True
    """Whether its worker loop started (False: still the training process's fork, not yet a worker)."""

    def describe(self) -> str:
        if self.syscall == "futex":
            doing = "asleep on a lock (futex)"
        elif self.state == "R" or self.syscall == "running":
            doing = "running"
        else:
            doing = f"state {self.state}" + (f", in system call {self.syscall}" if self.syscall else "")
        if not self.started:
            doing += " before its loop started"
        return f"{self.pid} {doing}, {self.cpu_seconds:.2f} s CPU"


def loader_workers(parent: int | None = None) -> list[WorkerState]:
    """The DataLoader workers whose parent is ``parent`` (default: this process), in pid order, with any
    child still a copy of it (its name and command line, one thread: forked, no worker loop yet); empty
    where ``/proc`` cannot be read."""
    parent = os.getpid() if parent is None else parent
    ticks = os.sysconf("SC_CLK_TCK")
    own = procfs.stat(parent)
    try:
        pids = sorted(int(n) for n in os.listdir("/proc") if n.isdigit())
    except OSError:
        return []
    if own is None:
        return []
    own_cmdline = _cmdline(parent)
    found: list[WorkerState] = []
    for pid in pids:
        read = procfs.stat(pid)
        if read is None:  # gone meanwhile
            continue
        name, fields = read
        if int(fields[procfs.PARENT]) != parent:
            continue
        started = name == WORKER_NAME
        copy = fields[procfs.THREADS] == "1" and name == own[0] and _cmdline(pid) == own_cmdline
        if not started and not copy:
            continue  # another child: spawned or exec'd, renamed, or one that started threads of its own
        cpu = (int(fields[procfs.USER_TICKS]) + int(fields[procfs.SYSTEM_TICKS])) / ticks
        found.append(WorkerState(pid, fields[procfs.STATE], _syscall(pid), cpu, started))
    return found


def fork_hint(workers: list[WorkerState]) -> str:
    """What the hang report adds for workers asleep on a lock: gh-112275 where one is stuck before its
    loop on a Python that has it; else ``FORK_HINT``; "" when none is."""
    asleep = [w for w in workers if w.syscall == "futex"]
    fix = fork_deadlock_fix()
    if fix is not None and any(not w.started for w in asleep):
        return (
            f"A worker asleep on a lock before its loop started is stuck inside its fork: this Python "
            f"({platform.python_version()}) has CPython gh-112275 (a thread entering Python as the worker "
            f"was forked). Use Python {fix} or later, or DataLoader(multiprocessing_context='forkserver')."
        )
    return FORK_HINT if asleep else ""


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _syscall(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/syscall") as f:
            first = f.read().split(maxsplit=1)[0]
    except (OSError, IndexError):  # another user's process, or a kernel without it
        return ""
    return "futex" if _FUTEX is not None and first == str(_FUTEX) else first
