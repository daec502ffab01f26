"""Lightning under torchrun: a rank that hangs inside a training step is stopped by the hang watchdog
(stacks dumped, exit 87), torchrun restarts the job, and it resumes from its newest commit to end
bitwise equal to an uninterrupted run, with the same samples per rank and step."""

from __future__ import annotations

import pytest

from tests.conftest import run_hung_and_reference
from tests.lightning.test_crash_resume import JOB
from tests.sameness import assert_same_run

pytestmark = pytest.mark.slow
TRAINING = ("--devices", "2", "--epochs", "2", "--every", "5")


def test_a_lightning_rank_hung_inside_a_step_is_restarted_and_resumes_exactly(tmp_path):
    reference, hung, out = run_hung_and_reference(JOB, tmp_path, *TRAINING)
    assert "Restored all states from the checkpoint" in out.stderr + out.stdout
    assert_same_run(hung, reference, ranks=2)
