"""``examples/transformers/train.py`` runs as documented, and a relaunch resumes where it left off."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import REPO
from tests.zygote import python

pytestmark = pytest.mark.slow
EXAMPLE = os.path.join(REPO, "examples/transformers/train.py")


def test_example_trains_then_a_relaunch_resumes(tmp_path):
    def run(steps: int) -> subprocess.CompletedProcess:
        args = [
            "--output-dir",
            str(tmp_path / "run"),
            "--steps",
            str(steps),
            "--save-steps",
            "8",
            "--workers",
            "0",
        ]
        return subprocess.run(
            [python(), EXAMPLE, *args],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": REPO},
        )

    first = run(16)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "starting fresh" in first.stdout and "done: step 16" in first.stdout
    again = run(24)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "checkpoint-16" in again.stdout and "done: step 24" in again.stdout
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == [
        "checkpoint-16",
        "checkpoint-24",
    ]
