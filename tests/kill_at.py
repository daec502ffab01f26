"""Kill the job's own process when a save reaches a phase: the crash tests' trigger (a core listener)."""

from __future__ import annotations

import os
import signal
import time


class KillAt:
    """Send ``signum`` to this process when the save of ``step`` reaches ``phase`` on ``rank``.

    It first waits (up to 60 s) for an earlier save to commit, if one was started, so that the crash
    always has a committed checkpoint to fall back to, however fast the steps are.
    """

    def __init__(self, step: int, phase: str, rank: int | None, signum: int = signal.SIGKILL) -> None:
        self.step, self.phase, self.rank, self.signum = step, phase, rank, signum
        self.started: set[int] = set()
        self.committed: set[int] = set()

    def on_event(self, event) -> None:
        phase = getattr(event, "phase", None)
        if phase == "snapshot_start":
            self.started.add(event.step)
        elif phase == "committed":
            self.committed.add(event.step)
        if phase != self.phase or event.step != self.step or self.rank not in (None, event.rank):
            return
        deadline = time.monotonic() + 60
        while any(s < self.step for s in self.started) and not any(s < self.step for s in self.committed):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        os.kill(os.getpid(), self.signum)
