"""Running ``tests/accelerate/job.py`` (one process, or two via ``accelerate launch``) and comparing runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

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


def run_job(
    workdir: Path,
    *args: str,
    processes: int = 1,
    expect_signal: int = 0,
    env: dict | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run the job; with ``expect_signal`` it must die of that signal (the launcher then exits 1)."""
    command = [*(LAUNCH if processes == 2 else [sys.executable]), JOB, str(workdir), *args]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
    )
    if not check:
        return out
    if expect_signal and processes == 1:
        assert out.returncode == -expect_signal, (
            f"expected signal {expect_signal} ({args}): rc={out.returncode}\n{out.stderr[-3000:]}"
        )
    elif expect_signal:  # torchrun reports the child's signal and exits 1
        name = signal.Signals(expect_signal).name
        assert out.returncode == 1 and name in out.stderr, f"expected {name} ({args}):\n{out.stderr[-3000:]}"
    else:
        assert out.returncode == 0, f"job failed ({args}):\n{out.stderr[-3000:]}"
    return out


def stats(workdir: Path) -> list[dict]:
    """The stats each finished launch of the job wrote (rank 0), oldest first."""
    files = sorted(workdir.glob("stats-*.json"), key=lambda p: p.stat().st_mtime)
    return [json.loads(p.read_text()) for p in files]
