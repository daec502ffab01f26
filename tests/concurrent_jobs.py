"""Several job launches at once (each in its own process group, output in WORKDIR/job.log).

Launches spend most of their time starting up and waiting on each other's ranks, not computing, so
tests that resume one checkpoint several ways run the resumes side by side.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.conftest import REPO


def start(command: list[str], workdir: Path) -> subprocess.Popen:
    """Start ``command`` (the repo importable); its output goes to WORKDIR/job.log."""
    with open(workdir / "job.log", "w") as log:
        return subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": REPO},
            start_new_session=True,  # a launcher and its ranks are killed together
        )


def finish(runs: dict[str, tuple[Path, subprocess.Popen]], timeout: float = 300) -> None:
    """Wait for every run; assert each exited 0 (with its log's tail); kill what is left on failure."""
    try:
        for what, (workdir, proc) in runs.items():
            proc.wait(timeout=timeout)
            log = (workdir / "job.log").read_text()[-3000:]
            assert proc.returncode == 0, f"{what} failed (rc={proc.returncode}):\n{log}"
    finally:
        for _, proc in runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
