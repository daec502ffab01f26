"""What a process holds (open files, threads) after each of several sessions run in it one after another:
printed by the scripts that run them (``tests/lightning/folds.py``, ``tests/transformers/trials.py``)
and checked by their tests."""

from __future__ import annotations

import os
import re


def report(rank: int, session: str, k: int) -> None:
    """Print this process's open files and threads after session ``k`` (``session``: its kind)."""
    files, threads = len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
    print(f"rank {rank} {session} {k}: {files} files, {threads} threads", flush=True)


def assert_no_more_held(output: str, session: str, sessions: int, ranks: int = 2) -> None:
    """Every rank holds no more files, and at most one more thread (a transient one), after the last
    session than after the second (the first may open what a process opens once: imports, a beacon)."""
    held = {
        (int(m[1]), int(m[2])): (int(m[3]), int(m[4]))
        for m in re.finditer(rf"rank (\d+) {session} (\d+): (\d+) files, (\d+) threads", output)
    }
    assert len(held) == ranks * sessions, output
    for rank in range(ranks):
        files = [held[rank, k][0] for k in range(sessions)]
        threads = [held[rank, k][1] for k in range(sessions)]
        assert files[-1] <= files[1], f"rank {rank}'s open files by {session}: {files}"
        assert threads[-1] <= threads[1] + 1, f"rank {rank}'s threads by {session}: {threads}"
