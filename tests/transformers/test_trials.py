"""A new ``AirTrainer`` trained per trial in the same DDP processes (a search loop of the user's)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.conftest import REPO
from tests.transformers.runs import TORCHRUN, TORCHRUN_ENV
from tests.zygote import python

pytestmark = pytest.mark.slow


def test_trials_trained_one_after_another_in_the_same_processes_hold_no_more_files_or_threads(tmp_path):
    """Each trial's session reuses the gloo groups its stop vote and local tier talk on
    (``side_groups.py``): both ranks voted as often, and the tier ended clean. Making them anew cost
    each rank 10 files and 6 threads more at every trial."""
    out = subprocess.run(
        [python(), *TORCHRUN, os.path.join(REPO, "tests/transformers/trials.py"), str(tmp_path), "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": REPO, **TORCHRUN_ENV},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    held = {
        (int(m[1]), int(m[2])): (int(m[3]), int(m[4]))
        for m in re.finditer(r"rank (\d) trial (\d): (\d+) files, (\d+) threads", out.stdout)
    }
    assert len(held) == 6, out.stdout
    for rank in (0, 1):
        files = [held[rank, trial][0] for trial in range(3)]
        threads = [held[rank, trial][1] for trial in range(3)]
        assert files[2] <= files[0], f"rank {rank}'s open files by trial: {files}"
        assert threads[2] <= threads[0] + 1, f"rank {rank}'s threads by trial: {threads}"
