"""A test job that stalls shows where: its stacks (and its loader workers') in files the test prints.

A test waits 300 s for a job that takes seconds, and a stall caught by pytest's timeout loses every
stack, while a failing test keeps only the tail of a long stderr. So a job calls ``arm`` first: a job
process still running after ``seconds`` writes every thread's stack to ``WORKDIR/stalled-<pid>.txt`` and
exits 1. Ten seconds before, the outermost job process sends SIGUSR1 to every process below it, one
at a time: each loader worker inherited a stack dump on that signal from the process that forked it
and writes to that process's ``stalled-<pid>-workers.txt`` (a rank can wait forever on a stuck
worker); a rank the job started (Lightning's rank 1) writes its own stacks to its own file of that name.
The test side reads them all with ``shown``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

DEFAULT_SECONDS = float(os.environ.get("AIR_TEST_STALL_SECONDS", 240))
_ARMED = "AIR_TEST_STALLS_ARMED"
"""Set in an armed process's environment: a job process it starts leaves the signalling to it."""


def arm(workdir: str, seconds: float = DEFAULT_SECONDS) -> None:
    """Call once, early, in each job process (before it forks loader workers)."""
    pid = os.getpid()
    workers = open(os.path.join(workdir, f"stalled-{pid}-workers.txt"), "ab", buffering=0)
    faulthandler.register(signal.SIGUSR1, file=workers, all_threads=True)

    def dump_children() -> None:  # one at a time: dumps into one file would interleave
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.send_signal(signal.SIGUSR1)
                time.sleep(0.5)

    if os.environ.get(_ARMED) != "1":  # the outermost: one pass over the tree, no two dumps at once
        os.environ[_ARMED] = "1"
        timer = threading.Timer(max(seconds - 10, 0), dump_children)
        timer.daemon = True
        timer.start()
    own = open(os.path.join(workdir, f"stalled-{pid}.txt"), "w")
    faulthandler.dump_traceback_later(seconds, exit=True, file=own)


def shown(workdir: str | Path, args: tuple[str, ...], out: subprocess.CompletedProcess) -> str:
    """A failing job's message: its arguments and exit code, each rank's exits under torchrun (rank,
    restart, status), the first line of each hang report (which launch, rank and step stopped), every
    non-empty stall file in ``workdir``, then the tail of its stderr."""
    root = Path(workdir)
    exits = root / "rank-exits.txt"
    head = f"--- rank restart exit:\n{exits.read_text()}" if exits.exists() else ""
    head += "".join(f"--- {f.name}: {f.read_text(errors='replace').split(chr(10), 1)[0]}\n"
                    for f in sorted(root.glob("**/.air-events/hang-*.txt")))  # fmt: skip
    found = [f for f in sorted(root.glob("stalled-*.txt")) if f.stat().st_size]
    files = "".join(f"--- {f.name}:\n{f.read_text(errors='replace')}\n" for f in found)
    return f"({args}): rc={out.returncode}\n{head}{files}{out.stderr[-12000:]}"
