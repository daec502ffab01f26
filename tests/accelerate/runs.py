"""Running ``tests/accelerate/job.py`` (one process, or two via ``accelerate launch``) and comparing runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests import stalls
from tests.conftest import REPO
from tests.zygote import python

JOB = os.path.join(REPO, "tests/accelerate/job.py")
# `accelerate launch --cpu` starts one process without MPI; on a CPU-only machine `--multi_gpu` starts
# the processes through torchrun, and Accelerate picks gloo (the job passes cpu=True as well).
LAUNCH = [
    sys.executable,
    "-m",
    "accelerate.commands.launch",
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
    "--main_process_port",
    "0",
]
LAUNCH_ARGS = LAUNCH[1:]
"""The interpreter's arguments of ``accelerate launch``, after ``python()`` (``tests/zygote.py``)."""


def run_job(
    workdir: Path,
    *args: str,
    processes: int = 1,
    expect_signal: int = 0,
    env: dict | None = None,
    check: bool = True,
    interpreter: str = "",
) -> subprocess.CompletedProcess:
    """Run the job; with ``expect_signal`` it must die of that signal (the launcher then exits 1).

    ``interpreter``: default ``python()``, the pre-imported one (``tests/zygote.py``)."""
    command = [interpreter or python(), *(LAUNCH_ARGS if processes == 2 else []), JOB, str(workdir), *args]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
    )
    if not check:
        return out
    shown = stalls.shown(workdir, args, out)
    if expect_signal and processes == 1:
        assert out.returncode == -expect_signal, f"expected signal {expect_signal} {shown}"
    elif expect_signal:  # torchrun reports the child's signal and exits 1
        name = signal.Signals(expect_signal).name
        assert out.returncode == 1 and name in out.stderr, f"expected {name} {shown}"
    else:
        assert out.returncode == 0, f"job failed {shown}"
    return out


def training_args(args: tuple[str, ...]) -> tuple[str, ...]:
    """The arguments of ``args`` that shape the training (what an uninterrupted reference run needs).

    ``--every`` (and ``--local-every``, ``--die``) is left out: when a job checkpoints must not change what
    it trains, so one reference
    (saving every 5 steps) serves every save interval, as in the Lightning tests. Defaults are dropped.
    """
    options, flags, rest = {}, [], list(args)
    while rest:
        arg = rest.pop(0)
        if arg in ("--no-augment", "--zip", "--seq"):
            flags.append(arg)
        elif arg == "--direct":  # where it saves, not what it trains
            continue
        else:
            options[arg] = rest.pop(0)
    for when in ("--every", "--local-every", "--die", "--step-sleep"):  # when it saves or dies, not what
        options.pop(when, None)
    for name, default in (("--workers", "0"), ("--loader", "plain")):
        if options.get(name) == default:
            del options[name]
    return tuple(x for item in sorted(options.items()) for x in item) + tuple(flags)


def stats(workdir: Path) -> list[dict]:
    """The stats each finished launch of the job wrote (rank 0), oldest first."""
    files = sorted(workdir.glob("stats-*.json"), key=lambda p: p.stat().st_mtime)
    return [json.loads(p.read_text()) for p in files]
