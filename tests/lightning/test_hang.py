"""Lightning under torchrun: a rank that hangs inside a training step is stopped by the hang watchdog
(stacks dumped, exit 87), torchrun restarts the job, and it resumes from its newest commit to end
bitwise equal to an uninterrupted run, with the same samples per rank and step."""

from __future__ import annotations

import pytest

from air_core.health import HANG_EXIT_CODE
from tests.conftest import run_torchrun
from tests.lightning.test_crash_resume import JOB
from tests.sameness import assert_same_run

pytestmark = pytest.mark.slow
TRAINING = ("--devices", "2", "--epochs", "2", "--every", "5")


def test_a_lightning_rank_hung_inside_a_step_is_restarted_and_resumes_exactly(tmp_path):
    reference, hung = tmp_path / "reference", tmp_path / "hung"
    reference.mkdir()
    hung.mkdir()
    run_torchrun(JOB, reference, *TRAINING)
    out = run_torchrun(JOB, hung, *TRAINING, "--hang", "13:1", "--hang-timeout", "3", restarts=1)
    assert (hung / "hung-once").exists(), "rank 1 hung in step 13 of the first launch"
    assert f"exitcode  : {HANG_EXIT_CODE}" in out.stderr or f"exitcode: {HANG_EXIT_CODE}" in out.stderr, (
        f"torchrun saw the watchdog's exit code {HANG_EXIT_CODE}:\n{out.stderr[-4000:]}"
    )
    (stacks,) = (hung / "ckpts" / ".air-events").glob("hang-*-rank00001.txt")
    assert "sleep_forever_in_a_step" in stacks.read_text(), "the stacks name where rank 1 hung"
    assert "Restored all states from the checkpoint" in out.stderr + out.stdout
    assert_same_run(hung, reference, ranks=2)
