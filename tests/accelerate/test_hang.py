"""A rank that hangs inside a training step: the watchdog dumps its stacks and exits 87, torchrun restarts
the job, and it resumes from its newest commit to end bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import re

from air_core.cli import main as air_cli
from air_core.session import goodput_of
from air_core.storage import Storage
from tests.accelerate.runs import JOB, stats
from tests.conftest import run_hung_and_reference
from tests.sameness import assert_same_run

TRAINING = ("--epochs", "2", "--every", "5")  # 8 steps per epoch on 2 processes, saves at 5, 10, 15


def test_a_rank_hung_inside_a_step_is_restarted_and_the_job_resumes_exactly(tmp_path, capsys):
    reference, hung, out = run_hung_and_reference(JOB, tmp_path, *TRAINING)
    root = hung / "ckpts"
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
