"""A rank that hangs inside a training step: the watchdog dumps its stacks and exits 87, torchrun restarts
the job, and it resumes from its newest commit to end bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import re

from air_core.cli import main as air_cli
from air_core.health import HANG_EXIT_CODE
from air_core.session import goodput_of
from air_core.storage import Storage
from tests.accelerate.runs import JOB, stats
from tests.conftest import run_torchrun
from tests.sameness import assert_same_run

TRAINING = ("--epochs", "2", "--every", "5")  # 8 steps per epoch on 2 processes, saves at 5, 10, 15


def test_a_rank_hung_inside_a_step_is_restarted_and_the_job_resumes_exactly(tmp_path, capsys):
    reference, hung = tmp_path / "reference", tmp_path / "hung"
    reference.mkdir()
    hung.mkdir()
    run_torchrun(JOB, reference, *TRAINING)
    out = run_torchrun(JOB, hung, *TRAINING, "--hang", "13:1", "--hang-timeout", "3", restarts=1)
    assert (hung / "hung-once").exists(), "rank 1 hung in step 13 of the first launch"
    assert f"exitcode  : {HANG_EXIT_CODE}" in out.stderr or f"exitcode: {HANG_EXIT_CODE}" in out.stderr, (
        f"torchrun saw the watchdog's exit code {HANG_EXIT_CODE}:\n{out.stderr[-4000:]}"
    )
    root = hung / "ckpts"
    (stacks,) = (root / ".air-events").glob("hang-*-rank00001.txt")
    assert "sleep_forever_in_a_step" in stacks.read_text(), "the stacks name where rank 1 hung"
    assert "sleep_forever_in_a_step" in out.stderr, "and went to the log"
    assert_same_run(hung, reference, ranks=2)
    (resumed,) = stats(hung)
    assert resumed["restores"][0][0] == "step-000000010", "resumed from the newest commit before the hang"
    goodput = goodput_of(Storage(str(root), storage_options={}, retries=0, retry_backoff_seconds=0.0))
    assert goodput.hang_count == 1 and goodput.launches == 2, f"the hang is in the goodput log: {goodput}"
    assert air_cli(["report", str(root)]) == 0
    report = capsys.readouterr().out
    assert "hang (launch 1): rank 1" in report and "lost to hangs (1)" in report, report
    record = json.loads(next((root / ".air-events").glob("hang-*-rank00001.json")).read_text())
    found = re.search(r"made no progress for ([\d.]+) s \(limit ([\d.]+) s", out.stderr)
    print(
        f"watchdog: setting 3 s, fired after {record['since']:.4f} s without progress ({found and found[0]})"
    )
