"""SIGKILL a real transformers ``Trainer`` job at each phase of a save; the relaunch must end bitwise equal.

Each test kills ``tests/transformers/job.py`` (``AirTrainer`` on a 2-layer GPT-2 built from a config)
when a chosen save reaches a chosen phase, relaunches the same command (it resumes through
``latest_checkpoint``), and compares the final weights and the sample ids and augmented tokens of every
micro-batch with an uninterrupted run. Samples get a token drawn from the RNG of whichever process
loads them (the main process, or a loader worker), and GPT-2's dropout draws from the main RNG.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from air_core.session.goodput import read_events
from air_core.storage import Storage
from tests.conftest import REPO
from tests.kill_at import read_journal
from tests.sameness import assert_same_run, assert_tier_read_in_place, records, resumed_at
from tests.torchrun_nodes import lose_node_b
from tests.transformers.runs import JOB, run_job, stats

pytestmark = pytest.mark.slow


def newest_told(workdir) -> int:
    """The newest step the killed launch was told committed (its journal)."""
    return max(e["step"] for e in read_journal(str(workdir)) if e["phase"] == "committed")


def resumed_step(workdir, told: int) -> int:
    """The step the relaunch resumed from: the newest committed. The kill at step 16 waits for some
    earlier commit (usually 12's); a save may commit in the instant before the kill, unjournaled."""
    step = int(stats(workdir)[0]["restores"][0][0].removeprefix("checkpoint-"))
    assert step in (4, 8, 12) and step >= told, f"resumed from step {step}, the newest told was {told}"
    return step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of some training arguments, run once per module."""
    cache: dict[tuple[str, ...], object] = {}

    def get(*args: str, processes: int = 1):
        key = (*args, str(processes))
        if key not in cache:
            cache[key] = tmp_path_factory.mktemp("reference")
            run_job(cache[key], *args, processes=processes)
        return cache[key]

    return get


# Every phase once, loader workers alternating. Saves every 4 steps; 12 batches per epoch, 24 steps.
@pytest.mark.parametrize(
    ("phase", "workers"),
    [("snapshot_start", "0"), ("serialize_start", "2"), ("upload_start", "0"), ("commit_start", "2")],
)
def test_sigkill_during_each_save_phase_resumes_exactly(tmp_path, reference, phase, workers):
    args = ("--workers", workers)
    run_job(tmp_path, *args, "--kill", f"16:{phase}", expect_signal=signal.SIGKILL)
    told = newest_told(tmp_path)
    run_job(tmp_path, *args)
    step = resumed_step(tmp_path, told)
    assert_same_run(tmp_path, reference(*args))
    assert stats(tmp_path)[0]["fetches"] == 24 - step, "fetch_seconds: one per training batch of this launch"


def test_gradient_accumulation_resumes_mid_epoch_exactly(tmp_path, reference):
    """Two micro-batches per step, 12 per epoch: a save at step 4 is 8 batches into the first epoch."""
    args = ("--ga", "2", "--steps", "10", "--every", "2")
    run_job(tmp_path, *args, "--kill", "6:serialize_start", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference(*args))


def test_gradient_accumulation_resumes_from_the_local_tier_exactly(tmp_path, reference):
    """Two micro-batches per step, the local tier every 3 steps: killed before step 8, the relaunch
    resumes from the local save of step 6, taken after that optimizer step (12 micro-batches in)."""
    args = ("--ga", "2", "--steps", "10", "--every", "10", "--local-every", "3")
    run_job(tmp_path, *args, "--die", "8", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args)
    assert_same_run(tmp_path, reference("--ga", "2", "--steps", "10", "--every", "2"))  # the test's above
    assert stats(tmp_path)[0]["restores"] == [["local-s000000006-w1", "local", "local"]]


@pytest.mark.parametrize(
    ("tier", "interrupt"),
    [
        (("--every", "12"), ("--kill", "24:upload_start")),  # the root's step 12, epoch 0's last
        (("--every", "100", "--local-every", "4"), ("--die", "15")),  # the local tier's step 12
    ],
    ids=["root", "local-tier"],
)
def test_a_users_draws_at_an_epoch_begin_after_an_epoch_end_checkpoint_are_kept(
    tmp_path, reference, tier, interrupt
):
    """A user's ``on_epoch_begin`` that draws from the RNG ran after the checkpoint of epoch 0's end,
    before epoch 1's first batch: the resume puts the RNG back before that hook
    (``AirTrainerCallback.on_epoch_begin``), not at the fetch. The local tier's save there is taken
    before the epoch's first fetch, its pass begun: it goes on at that fetch, as before."""
    args = ("--workers", "2", "--draw-in", "on_epoch_begin")
    run_job(tmp_path, *args, *tier, *interrupt, expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args, *tier)
    assert_same_run(tmp_path, reference(*args))
    assert resumed_at(tmp_path) == 12


def test_s3_root_resumes_exactly_from_the_staged_copy(tmp_path, reference, s3_root):
    s3 = ("--root", s3_root.url, "--endpoint", s3_root.endpoint)
    run_job(tmp_path, *s3, "--kill", "16:upload_start", expect_signal=signal.SIGKILL)
    told = newest_told(tmp_path)
    run_job(tmp_path, *s3)
    assert_same_run(tmp_path, reference())
    resumed_step(tmp_path, told)
    assert stats(tmp_path)[0]["restores"][0][1] == "cache", "the staged copy served it"


def test_sigterm_during_an_upload_commits_the_inflight_save_then_resumes_exactly(tmp_path, reference):
    """A scheduler's SIGTERM while step 16's save uploads. ``Trainer`` has no SIGTERM handler of its own:
    the session commits that save, then the default action ends the process; the relaunch resumes from it."""
    out = run_job(tmp_path, "--sigterm", "16:upload_start", expect_signal=signal.SIGTERM)
    assert "flushed the in-flight checkpoint (SIGTERM)" in out.stderr, out.stderr[-3000:]
    assert (tmp_path / "ckpts/.air/checkpoint-16/manifest.json").exists(), "the save in flight committed"
    run_job(tmp_path)
    # Step 20's save too when the loop, fast on a tiny model, was already in it (waiting for step 16's
    # buffer) as SIGTERM came: every save begun commits.
    assert stats(tmp_path)[0]["restores"][0][0] in ("checkpoint-16", "checkpoint-20")
    assert_same_run(tmp_path, reference())
    # The steps the report counts as recomputed are those the first launch ran past the resumed one, and
    # the step the SIGTERM's default action ended midway when the flush was done before that step's end
    # (its ``cut`` event: it began and never ended; the relaunch does it again). A cut step may have
    # written its record (the process ended after its loss) or not (it ended before): counted once.
    ran = _steps_before_the_relaunch(tmp_path)
    failure = _failure(tmp_path)
    cut = _cut_steps(tmp_path)
    resumed = failure["resumed_from_step"]
    redone = set(range(resumed + 1, ran + 1)) | {s for s in cut if s > resumed}
    assert failure["recomputed_steps"] == len(redone), (ran, cut, failure)


def test_a_step_a_sigterm_stopped_midway_is_recomputed_with_its_samples(tmp_path):
    """A SIGTERM while step 4's save uploads, each step longer than the flush (2 s): the process ends at
    once after the flush, inside the step under way, which the relaunch does again. Its end never came,
    so the log had no step event of it, and the report counted one step (and its samples) too few."""
    run_job(tmp_path, "--sigterm", "4:upload_start", "--step-sleep", "2", expect_signal=signal.SIGTERM)
    run_job(tmp_path)
    ran = _steps_before_the_relaunch(tmp_path)
    failure = _failure(tmp_path)
    redone = ran - failure["resumed_from_step"]
    assert redone >= 1, (ran, failure)
    assert (failure["recomputed_steps"], failure["repeated_samples"]) == (redone, 4 * redone), (ran, failure)


def _failure(workdir) -> dict:
    """The one failure of ``air report --json``'s ``work``."""
    report = subprocess.run(
        [sys.executable, "-m", "air_core.cli", "report", "--json", str(workdir / "ckpts")],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    (failure,) = json.loads(report.stdout)["work"]["per_failure"]
    return failure


def _cut_steps(workdir) -> list[int]:
    """The steps the first launch's goodput log says a SIGTERM cut short (begun, never ended)."""
    storage = Storage(str(workdir / "ckpts"), storage_options={}, retries=0, retry_backoff_seconds=0)
    first = read_events(storage)[0]
    ended = {e["s"] for e in first if e["e"] == "step"}
    return [e["s"] for e in first if e["e"] == "cut" and e["s"] not in ended]


def _steps_before_the_relaunch(workdir) -> int:
    """The steps the first launch began (one record each, ``--ga 1``), from the records' order."""
    rows = records(workdir)
    return next(i for i in range(1, len(rows)) if rows[i]["step"] <= rows[i - 1]["step"])


def test_sigterm_to_one_process_before_its_save_stops_both_after_that_save(tmp_path, reference):
    """torchrun, gloo: SIGTERM reaches rank 1 at the end of step 16, before Trainer saves it, while rank 0
    goes on into that save: both stop together before a later step, with step 16 committed. Steps of
    50 ms, so that the ranks vote at each (they vote about every 50 ms)."""
    args = ("--workers", "2")
    sigterm = ("--sigterm-before-save", "16:1", "--step-sleep", "0.05")
    out = run_job(tmp_path, *args, *sigterm, processes=2, expect_signal=signal.SIGTERM)
    assert "another rank had a SIGTERM: stopping with it" in out.stderr, "rank 0 stopped with rank 1"
    assert (tmp_path / "ckpts/.air/checkpoint-16/manifest.json").exists(), "step 16 committed"
    run_job(tmp_path, *args, processes=2)
    assert stats(tmp_path)[0]["restores"][0][0] == "checkpoint-16"
    assert_same_run(tmp_path, reference(*args, processes=2), ranks=2)


def test_newest_after_the_first_save_was_killed_before_its_commit_starts_fresh(tmp_path, reference):
    """The first save's folder is complete but never committed: it is AirTrainer's, not a stock run's.
    ``NEWEST`` (the job's resume with a local tier; this one never saves locally) refused it as a stock
    checkpoint and named that uncommitted folder as the one to resume."""
    args = ("--local-every", "100")
    run_job(tmp_path, *args, "--kill", "4:commit_start", expect_signal=signal.SIGKILL)
    assert (tmp_path / "ckpts/checkpoint-4/trainer_state.json").exists(), "every file of step 4 was written"
    run_job(tmp_path, *args)
    assert stats(tmp_path)[0]["restores"] == [], "started fresh"
    assert_same_run(tmp_path, reference())


def test_two_processes_killed_mid_save_resume_exactly_per_rank(tmp_path, reference):
    """torchrun, gloo: both ranks are killed in the save of step 16 and resume from the newest commit."""
    args = ("--workers", "2")
    run_job(tmp_path, *args, "--kill", "16:serialize_start", processes=2, expect_signal=signal.SIGKILL)
    told = newest_told(tmp_path)
    run_job(tmp_path, *args, processes=2)
    assert_same_run(tmp_path, reference(*args, processes=2), ranks=2)
    resumed_step(tmp_path, told)


# The local tier: a save every 3 steps on the node, the root's every 10; every process is SIGKILLed at
# once before step 18. Step 17's optimizer step waited until the local save of step 15 was committed
# (and copied to the partner, with two nodes), so ``resume_from_checkpoint=NEWEST`` continues from step
# 15, not the root's 10.
TIER = ("--workers", "2", "--every", "10", "--local-every", "3")


def test_sigkill_between_root_saves_resumes_from_the_local_tier_exactly(tmp_path, reference):
    run_job(tmp_path, *TIER, "--die", "18", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *TIER)
    assert_same_run(tmp_path, reference("--workers", "2"))  # the tier changes nothing in the training
    resumed = resumed_at(tmp_path)
    assert resumed == 15, f"resumed from the newest local checkpoint, not the root's step 10: {resumed}"
    assert stats(tmp_path)[0]["restores"] == [["local-s000000015-w1", "local", "local"]]
    assert_tier_read_in_place(tmp_path)


def _gone(agent: subprocess.Popen) -> bool:
    """Node C joins once node B's agent is gone."""
    return agent.poll() is not None


def test_a_lost_node_replaced_by_a_new_one_resumes_from_the_partner_copy_exactly(tmp_path, reference):
    """Two torchrun agents on 127.0.0.1 are nodes A and B of a job of fixed size (``--nnodes 2:2``), one
    process each. Node B (its agent and its process) is lost before step 18; A's process fails on the
    broken process group and A's agent waits for a node to take B's place. Node C joins with an empty
    local folder: step 15 is assembled from A's own part and A's copy of B's (C receives both from A),
    and the job ends bitwise equal to an uninterrupted two-process run."""
    logs = lose_node_b(JOB, tmp_path, *TIER, "--die", "18:B", min_nodes=2, replace_when=_gone)
    log = logs["A"] + logs["C"]
    assert "resuming from local tier step 15 (replica)" in log, log[-4000:]
    assert "from node A, rank 1: from node A" in log, "the new node received both parts from A"
    assert stats(tmp_path)[0]["restores"] == [["local-s000000015-w2", "local", "replica"]]
    assert_same_run(tmp_path, reference("--workers", "2", processes=2), ranks=2)


def test_a_rank_whose_peer_on_another_node_was_lost_stops_at_once_and_a_new_node_takes_its_place(
    tmp_path, reference
):
    """As ``tests/accelerate/test_node_loss.py``'s lost-peer test, through ``AirTrainer`` in a job of fixed
    size: node B is lost while A's process spends 200 s in a step outside any collective. A's watchdog sees
    B's liveness beacon close without a farewell and exits with 87 at once, not when the step ends (past
    this test's bound) and its collective fails; A's agent then waits for node C, and the job resumes from
    the local tier and ends bitwise equal to an uninterrupted two-process run."""
    args = (*TIER, "--die", "18:B", "--nap", "18:A:200")
    logs = lose_node_b(JOB, tmp_path, *args, timeout=150, min_nodes=2, replace_when=_gone)
    log = logs["A"]
    assert "ended without ending its training" in log and "exitcode: 87" in log, log[-4000:]
    assert "resuming from local tier step 15" in log + logs["C"], log[-4000:]
    assert_same_run(tmp_path, reference("--workers", "2", processes=2), ranks=2)
