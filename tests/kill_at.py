"""The crash tests' trigger and witness: core listeners installed by the test jobs.

``KillAt`` kills the job's own process when a save (or a retention delete, or a restore) reaches a
phase, optionally some milliseconds later from a timer, so the kill lands *inside* that phase while it
runs. ``Journal`` appends what the checkpointer reported (committed, deleted by retention) to a file,
fsynced before the pipeline goes on, so a test can tell after a SIGKILL what the job was told.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import NoReturn

from air_core import procfs
from tests import zygote


class KillAt:
    """Send ``signum`` to this process when the save of ``step`` reaches ``phase`` on ``rank`` (or on the
    rank of node ``node``, ``AIR_NODE_NAME``); ``agent``: SIGKILL its torchrun agent too (the node is lost).

        ``step`` None matches any step (a restore's step is not known in advance). It first waits (up to
        60 s) for an earlier save to commit, if one was started, so that the crash always has a committed
        checkpoint to fall back to, however fast the steps are.
    """

    def __init__(
        self,
        step: int | None,
        phase: str,
        rank: int | None,
        signum: int = signal.SIGKILL,
        delay_seconds: float = 0.0,
        group: bool = False,
        node: str = "",
        agent: bool = False,
    ) -> None:
        self.step, self.phase, self.rank, self.signum = step, phase, rank, signum
        self.node, self.agent = node, agent
        self.delay_seconds = delay_seconds
        self.group = group
        if group and os.getpgrp() != os.getpid():  # lead a group of its own, before loader workers fork
            os.setpgid(0, 0)
        self.started: set[int] = set()
        self.committed: set[int] = set()
        self.fired = False

    @classmethod
    def parse(cls, spec: str, signum: int = signal.SIGKILL, *, group: bool = False) -> KillAt:
        """``STEP:PHASE[:WHO][:agent][+DELAY_MS]``, STEP ``*`` for any step, WHO a rank or a node's name
        (``:agent``: that node is lost); ``group``: to this process's group (its loader workers too, as
        SLURM and Kubernetes signal a job), which it leads from then on."""
        spec, _, delay = spec.partition("+")
        step, phase, *who = spec.split(":")
        agent = who[-1:] == ["agent"]
        who = who[:-1] if agent else who
        rank = int(who[0]) if who and who[0].isdigit() else None
        node = who[0] if who and rank is None else ""
        step_at = None if step == "*" else int(step)
        return cls(step_at, phase, rank, signum, float(delay or 0) / 1000, group, node, agent)

    def on_event(self, event) -> None:
        phase = getattr(event, "phase", None)
        if phase == "snapshot_start":
            self.started.add(event.step)
        elif phase == "committed":
            self.committed.add(event.step)
        if self.fired or phase != self.phase or self.step not in (None, event.step):
            return
        if self.rank not in (None, event.rank) or self.node not in ("", os.environ.get("AIR_NODE_NAME")):
            return
        self.fired = True
        deadline = time.monotonic() + 60
        while any(s < event.step for s in self.started) and not any(s < event.step for s in self.committed):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if self.delay_seconds:  # the phase goes on; the kill lands somewhere inside it
            timer = threading.Timer(self.delay_seconds, self._send)
            timer.daemon = True
            timer.start()
        else:
            self._send()

    def _send(self) -> None:
        if self.agent:
            die(agent=True)
        if self.group:
            os.killpg(os.getpgrp(), self.signum)
        else:
            os.kill(os.getpid(), self.signum)


class Journal:
    """Append ``committed`` and retention events of each rank to ``<workdir>/journal-rank<R>.jsonl``."""

    PHASES = ("committed", "retention_start", "retention_deleted")

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir

    def on_event(self, event) -> None:
        if getattr(event, "phase", None) not in self.PHASES:
            return
        line = json.dumps({"phase": event.phase, "name": event.name, "step": event.step})
        with open(os.path.join(self.workdir, f"journal-rank{event.rank}.jsonl"), "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_journal(workdir: str, rank: int = 0) -> list[dict]:
    path = os.path.join(workdir, f"journal-rank{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def nap_once(workdir: str, spec: str, step: int) -> None:
    """``--nap STEP:NODE:SECONDS`` of the test jobs, called at each step (1-based): in step STEP the rank of
    node NODE (``AIR_NODE_NAME``) spends SECONDS outside any collective (a long step: as a rank waits in a
    GPU collective), first launch only (a marker file)."""
    at, node, seconds = spec.split(":")
    marker = os.path.join(workdir, "napped-once")
    if step == int(at) and node == os.environ.get("AIR_NODE_NAME") and not os.path.exists(marker):
        open(marker, "w").close()
        busy(float(seconds))


def hang_timeout(spec: str, seconds: float) -> float | None:
    """``hang_timeout_seconds`` for ``--hang STEP:RANK --hang-timeout SECONDS``: SECONDS on that rank in the
    first launch (where it hangs), else None (the derived limit). The others wait for it in a collective;
    the restarted launch has nothing to catch, and a stall of a loaded host past the short limit there
    would stop it with no restart left."""
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    return seconds if int(os.environ.get("RANK", "0")) == int(spec.split(":")[1]) else None


def busy(seconds: float) -> None:
    """Spend ``seconds`` inside a step as training would: the main thread runs Python between short waits,
    so a process-directed signal that the kernel gave another thread (the writer's, which sent it) reaches
    its handler within 50 ms; one long sleep held it back to the sleep's end, and the step ended first."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))


def die(*, agent: bool = False, children: bool = False) -> NoReturn:
    """SIGKILL this process at once: its torchrun agent first with ``agent`` (the node is lost), its child
    processes first with ``children`` (the other ranks Lightning's launcher started, and loader workers).
    Nothing is waited for: what survives is what the local tier's gate promises (every rank's local save
    of a step is committed and copied before the next step's optimizer step)."""
    if agent:
        os.kill(zygote.parent(), signal.SIGKILL)
    for pid in _children() if children else []:
        os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL was sent to this process")


def _children() -> list[int]:
    """This process's child processes (Linux ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        read = procfs.stat(entry) if entry.isdigit() else None
        if read is not None and int(read[1][procfs.PARENT]) == os.getpid():
            found.append(int(entry))
    return found
