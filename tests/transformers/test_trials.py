"""A new ``AirTrainer`` trained per trial in the same DDP processes (a search loop of the user's)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import REPO
from tests.held import assert_no_more_held
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
    assert_no_more_held(out.stdout, "trial", 3)
