"""Running ``tests/accelerate/job.py`` (one process, or two via ``accelerate launch``) and comparing runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

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


def step_ids(workdir: Path, rank: int = 0) -> list[list[int]]:
    """Sample ids per step; a step replayed after a crash counts once (its last run)."""
    by_step: dict[int, list[int]] = {}
    for line in (workdir / f"ids-rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["ids"]
    assert sorted(by_step) == list(range(len(by_step))), "every step ran, none was skipped"
    return [by_step[s] for s in sorted(by_step)]


def assert_same_run(resumed: Path, reference: Path, ranks: int = 1) -> None:
    for rank in range(ranks):
        assert step_ids(resumed, rank) == step_ids(reference, rank), f"rank {rank} saw other samples"
    got, want = torch.load(resumed / "final.pt"), torch.load(reference / "final.pt")
    assert all(torch.equal(got[k], want[k]) for k in want), "final weights must be bitwise equal"


def stats(workdir: Path) -> list[dict]:
    """The stats each finished launch of the job wrote (rank 0), oldest first."""
    files = sorted(workdir.glob("stats-*.json"), key=lambda p: p.stat().st_mtime)
    return [json.loads(p.read_text()) for p in files]
