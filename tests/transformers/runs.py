"""Running ``tests/transformers/job.py`` (one process, or two through torchrun) and reading its results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from tests import stalls
from tests.conftest import REPO
from tests.zygote import python

JOB = os.path.join(REPO, "tests/transformers/job.py")
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# torchrun's agent shares its rendezvous store with the workers (pytorch#135712): each launch its own. A
# TORCH* variable sends a launch to the real interpreter (tests/zygote.py), so only torchrun's get it.
TORCHRUN_ENV: dict[str, str] = {}


def run_job(
    workdir: Path, *args: str, processes: int = 1, expect_signal: int = 0, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the job; with ``expect_signal`` it must die of that signal (torchrun then exits 1)."""
    command = [python(), *(TORCHRUN if processes == 2 else []), JOB, str(workdir), *args]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": REPO, **(TORCHRUN_ENV if processes == 2 else {}), **(env or {})},
    )
    shown = stalls.shown(workdir, args, out)
    if expect_signal and processes == 1:
        assert out.returncode == -expect_signal, f"expected signal {expect_signal} {shown}"
    elif expect_signal:
        name = signal.Signals(expect_signal).name
        assert out.returncode == 1 and name in out.stderr, f"expected {name} {shown}"
    else:
        assert out.returncode == 0, f"job failed {shown}"
    return out


def stats(workdir: Path) -> list[dict]:
    """The stats each finished launch wrote (process 0), oldest first."""
    files = sorted(workdir.glob("stats-*.json"), key=lambda p: p.stat().st_mtime)
    return [json.loads(p.read_text()) for p in files]
