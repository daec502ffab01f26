"""Seeded process-fault trials: plan one from a seed, run it, audit the root, compare with a clean run.

A trial kills a real training job (``tests/lightning/job.py`` or ``tests/accelerate/job.py``) with
SIGKILL, or preempts it with SIGTERM, at a phase of a save, a retention delete or a restore, some
milliseconds into that phase; relaunches the same command until it finishes; and asserts:

- no committed checkpoint under the root is ever unreadable (every file present, CRC-32 equal),
  checked after every launch;
- no checkpoint the job was told is committed is missing, unless retention deleted it;
- the resumed run's sample ids (per step, per rank) and final weights equal the uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import psutil

from air_core.events import Phase
from air_core.recovery import scan, verify
from air_core.storage import Storage
from tests.conftest import REPO
from tests.kill_at import read_journal
from tests.zygote import python

JOBS = {"lightning": "tests/lightning/job.py", "accelerate": "tests/accelerate/job.py"}
_PHASES = get_args(Phase)
SAVE_PHASES = list(_PHASES[: _PHASES.index("committed") + 1])  # snapshot_start ... committed
EVERY, STEPS = 4, 48  # both jobs: 16 batches per epoch (one rank), 3 epochs, a save every 4 steps


@dataclass
class Plan:
    """What one seeded trial does; ``launches`` are the extra arguments of each killed launch."""

    adapter: str
    seed: int
    workers: int
    s3: bool
    processes: int
    launches: list[tuple[str, str]]
    """(signal name, kill spec) of each launch that is interrupted; a last clean launch follows."""
    writer: str = "thread"
    """The adapters' ``writer=``; the clean run it is compared with uses the thread writer."""

    @property
    def base_args(self) -> list[str]:
        args = ["--workers", str(self.workers), "--every", str(EVERY), "--writer", self.writer]
        if self.adapter == "lightning":
            args += ["--top-k", "1"]  # ModelCheckpoint deletes the previous one: retention on every save
            if self.processes == 2:
                args += ["--devices", "2"]
        return args

    def describe(self) -> str:
        where = "s3" if self.s3 else "local"
        kills = ", ".join(f"{sig} at {spec}" for sig, spec in self.launches)
        setup = f"workers={self.workers} ranks={self.processes} {where} writer={self.writer}"
        return f"{self.adapter} seed={self.seed} {setup}: {kills}"


def plan(adapter: str, seed: int, *, processes: int = 1) -> Plan:
    """A trial drawn from ``seed``: where to kill, how, how late into the phase, with what loader and
    writer (drawn apart, so that the other draws of a seed are those of the suite before it had one)."""
    writer = random.Random(f"{adapter}-{seed}-{processes}-writer").choice(["thread", "thread", "process"])
    return dataclasses.replace(_plan(adapter, seed, processes), writer=writer)


def _plan(adapter: str, seed: int, processes: int) -> Plan:
    rng = random.Random(f"{adapter}-{seed}-{processes}")
    workers = rng.choice([0, 0, 2])
    s3 = processes == 1 and rng.random() < 0.25

    def delay() -> str:
        return "" if rng.random() < 0.4 else f"+{rng.randint(1, 40)}"

    kind = rng.choices(["save", "retention", "restore", "sigterm"], weights=[6, 2, 1, 2])[0]
    rank = f":{rng.randint(0, processes - 1)}" if processes > 1 else ""
    if processes > 1:  # one rank killed while the others go on; the launcher tears the job down
        kind = rng.choice(["save", "retention"])
        if kind == "retention":
            rank = ":0"  # rank 0 alone deletes
    steps = STEPS // processes  # the ranks share each epoch's batches
    if kind == "retention":
        # A retention event carries the step of the checkpoint it deletes: the Lightning job keeps 1
        # (save_top_k=1), the Accelerate job 3 (keep_last=3); the last deletion is left out, so that a
        # delayed kill still lands before the job ends.
        keep = 1 if adapter == "lightning" else 3
        step = rng.randrange(EVERY, steps - (keep + 1) * EVERY + 1, EVERY)
    else:  # a save after the second: the kill always has a committed checkpoint to fall back to
        step = rng.randrange(2 * EVERY, steps - EVERY + 1, EVERY)
    if kind == "retention":
        kill = f"{step}:retention_start{rank}{delay()}"
        return Plan(adapter, seed, workers, s3, processes, [("SIGKILL", kill)])
    phase = rng.choice([p for p in SAVE_PHASES if processes > 1 or p != "part_written"])  # ranks > 1 only
    if kind == "sigterm":
        return Plan(adapter, seed, workers, s3, processes, [("SIGTERM", f"{step}:{phase}{delay()}")])
    launches = [("SIGKILL", f"{step}:{phase}{rank}{delay()}")]
    if kind == "restore":  # the relaunch is killed while it restores; a third launch finishes
        launches.append(("SIGKILL", f"*:restore_start{delay()}"))
    return Plan(adapter, seed, workers, s3, processes, launches)


@dataclass
class Outcome:
    """Counts of one trial, for the suite's report."""

    plan: Plan
    faults: dict[str, int] = field(default_factory=dict)
    committed_seen: int = 0
    lost: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    wrong_resume: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "trial": self.plan.describe(),
            "faults": self.faults,
            "committed_seen": self.committed_seen,
            "lost": self.lost,
            "unreadable": self.unreadable,
            "wrong_resume": self.wrong_resume,
        }


def launch(plan: Plan, workdir: Path, extra: list[str], root: tuple[str, dict] | None) -> tuple[int, str]:
    """Run one launch to its end; return (exit code, stderr).

    Plays the scheduler's part when a rank dies: a rank left waiting in a collective for a dead peer is
    killed a few seconds later, with the rest of the job (torchrun does this for Accelerate by itself).
    """
    job = os.path.join(REPO, JOBS[plan.adapter])
    args = [*plan.base_args, *extra]
    if root is not None:
        args += ["--root", root[0], "--endpoint", root[1]["client_kwargs"]["endpoint_url"]]
    if plan.processes == 2 and plan.adapter == "accelerate":
        from tests.accelerate.runs import LAUNCH_ARGS

        command = [python(), *LAUNCH_ARGS, job, str(workdir), *args]
    else:
        command = [python(), job, str(workdir), *args]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "PYTHONPATH": REPO},
            start_new_session=True,
        )
        try:
            _watch(proc, plan.processes, workdir)
        finally:
            with contextlib.suppress(ProcessLookupError):  # orphaned ranks, worker processes
                os.killpg(proc.pid, signal.SIGKILL)
        err.seek(0)
        return proc.returncode, err.read()


def _watch(
    proc: subprocess.Popen, ranks: int, workdir: Path, grace: float = 5.0, limit: float = 300.0
) -> None:
    deadline = time.monotonic() + limit
    seen = lost_at = 0.0
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError("the job did not finish within 300 s")
        if ranks > 1:
            alive = running_ranks(workdir)
            seen = max(seen, alive)
            if seen >= ranks and alive < ranks and not lost_at:
                lost_at = time.monotonic()
            if lost_at and time.monotonic() - lost_at > grace:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return
        time.sleep(0.2)


def running_ranks(workdir: Path) -> int:
    """The live processes that run a job on ``workdir``: the launch itself, its ranks and their loader
    workers; or, with ``tests/zygote.py``, the launchers of the launch and of each rank (each lives as
    long as what it started; the forked programs carry the server's command line)."""
    count = 0
    for p in psutil.process_iter(["cmdline"]):
        command = p.info["cmdline"] or []  # None for a zombie
        count += str(workdir) in command and any(arg.endswith("job.py") for arg in command)
    return count


def audit(outcome: Outcome, workdir: Path, root: tuple[str, dict] | None) -> None:
    """After a launch: every committed checkpoint reads back; none the job was told of is missing."""
    url, options = root if root is not None else (str(workdir / "ckpts"), {})
    storage = Storage(url, storage_options=options, retries=2, retry_backoff_seconds=0.05)
    infos = scan(storage)
    with tempfile.TemporaryDirectory() as cache:
        for info in infos:
            if info.status == "corrupt":
                outcome.unreadable.append(f"{info.name}: {info.reason}")
            elif info.status == "committed":
                problem = verify(storage, info, None if storage.is_local else cache, max_transfers=4)
                if problem:
                    outcome.unreadable.append(f"{info.name}: {problem}")
    committed = {i.name for i in infos if i.status == "committed"}
    journal = [e for r in range(outcome.plan.processes) for e in read_journal(str(workdir), r)]
    told = {e["name"] for e in journal if e["phase"] == "committed"}
    deleting = {e["name"] for e in journal if e["phase"] == "retention_start"}
    outcome.committed_seen = len(told)
    outcome.lost = sorted(told - deleting - committed)


def run_trial(plan: Plan, workdir: Path, reference: Path, root: tuple[str, dict] | None) -> Outcome:
    """Run every interrupted launch of ``plan``, then the clean one; audit after each."""
    from tests.sameness import assert_same_run

    outcome = Outcome(plan)
    for sig, spec in plan.launches:
        flag = "--sigterm" if sig == "SIGTERM" else "--kill"
        rc, stderr = launch(plan, workdir, [flag, spec], root)
        died = rc != 0  # killed, preempted, or torn down after a rank's death
        # A surviving rank may also fail by itself: its collective with the dead peer breaks (gloo says
        # "reset" when the peer's socket resets, "closed" when it reads its end).
        broken = ("Connection reset by peer", "Connection closed by peer")
        lost_peer = plan.processes > 1 and any(message in stderr for message in broken)
        expected = not died or sig in stderr or rc < 0 or lost_peer
        assert expected, f"{plan.describe()}: launch failed:\n{stderr[-4000:]}"
        if died or not (workdir / "final.pt").exists():  # Lightning ends a fit SIGTERM stopped with exit 0
            phase = spec.split(":")[1].split("+")[0]
            key = f"{sig} in {phase}"
            outcome.faults[key] = outcome.faults.get(key, 0) + 1
        audit(outcome, workdir, root)
    rc, stderr = launch(plan, workdir, [], root)
    assert rc == 0, f"{plan.describe()}: the resumed launch failed:\n{stderr[-4000:]}"
    audit(outcome, workdir, root)
    try:
        assert_same_run(workdir, reference, ranks=plan.processes)
    except AssertionError as exc:
        outcome.wrong_resume = str(exc)
    return outcome
