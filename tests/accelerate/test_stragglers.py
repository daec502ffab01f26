"""Two gloo processes under ``accelerate launch``, one slowed in its forward by a fixed factor: it is named
the straggler with a score near 1/factor (and stops the job when asked); a balanced run names nobody."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from air_core.session.goodput import read_events
from air_core.storage import Storage
from tests.accelerate.runs import LAUNCH_ARGS
from tests.conftest import REPO
from tests.zygote import python

pytestmark = pytest.mark.slow
JOB = os.path.join(REPO, "tests/accelerate/straggler_job.py")


def _launch(workdir: Path, *args: str) -> tuple[list[dict], list[dict]]:
    """Run the job on two processes; return each rank's result and rank 0's goodput events."""
    out = subprocess.run(
        [python(), *LAUNCH_ARGS, JOB, str(workdir), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert out.returncode == 0, f"job failed ({args}):\n{out.stderr[-3000:]}"
    results = [json.loads((workdir / f"result-rank{r}.json").read_text()) for r in (0, 1)]
    storage = Storage(str(workdir / "ckpts"), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    return results, [e for launch in read_events(storage) for e in launch]


def test_a_rank_three_times_slower_is_named_and_stops_the_job_after_committing(tmp_path):
    results, events = _launch(tmp_path, "--slow-ms", "40", "--stop")
    for r in results:  # every process raised StragglerError at the first window end, step 8
        assert r.get("ranks") == [1] and r["step"] == 8, f"rank {r['rank']} should stop naming rank 1: {r}"
        assert "rank 1 (" in r["error"] and "stop_on_straggler=False" in r["error"]
    relative = results[0]["relative"][1]
    assert 0.15 <= relative <= 0.6, f"rank 1's relative score should be near 1/3, got {relative}"
    assert results[0]["relative"][0] == 1.0 and results[0]["named"] == [1]
    stragglers = [e for e in events if e["e"] == "straggler"]
    assert [(e["s"], e["ranks"]) for e in stragglers] == [(8, [1])], "one goodput event, at step 8"
    assert stragglers[0]["relative"][0] == relative and stragglers[0]["hosts"] == results[0]["hosts"][1:]
    saves = [e["s"] for e in events if e["e"] == "save" and e["committed"]]
    assert saves == [4], "the save of step 4 committed before the stop; none after it"


def test_a_balanced_run_names_no_straggler(tmp_path):
    results, events = _launch(tmp_path)
    assert all("error" not in r for r in results), f"no stop expected: {results}"
    assert results[0]["window"] == 24 and results[0]["named"] == [], f"last window: {results[0]}"
    assert min(results[0]["relative"]) > 0.75, f"balanced ranks score near 1: {results[0]['relative']}"
    assert [e for e in events if e["e"] == "straggler"] == [], "no straggler event in the goodput log"
