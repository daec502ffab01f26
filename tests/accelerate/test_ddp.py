"""Two gloo processes started by ``accelerate launch``, as a user starts them: exact per-rank resume."""

from __future__ import annotations

import signal
from importlib.metadata import version

import pytest
from packaging.version import Version

from tests.accelerate.runs import run_job, stats, training_args
from tests.sameness import assert_same_run, assert_tier_read_in_place

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted two-rank run of a test's training arguments (``runs.training_args``), run once."""
    cache: dict[tuple[str, ...], object] = {}

    def get(*args: str):
        key = training_args(args)
        if key not in cache:
            cache[key] = tmp_path_factory.mktemp("reference-ddp")
            run_job(cache[key], *key, processes=2)
        return cache[key]

    return get


# Every phase once, loader workers alternating (tests/faults draws phases x workers at random).
@pytest.mark.parametrize(
    ("phase", "workers"),
    [("snapshot_start", "0"), ("serialize_start", "2"), ("upload_start", "0"), ("commit_start", "2")],
)
def test_two_ranks_killed_mid_epoch_during_each_save_phase_resume_exactly(
    tmp_path, reference, phase, workers
):
    args = ("--workers", workers)
    run_job(tmp_path, *args, "--kill", f"10:{phase}", processes=2, expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args, processes=2)
    assert_same_run(tmp_path, reference(*args), ranks=2)


def test_two_ranks_killed_between_root_saves_resume_from_their_local_tier_exactly(tmp_path, reference):
    args = ("--every", "5", "--local-every", "2")
    run_job(tmp_path, *args, "--die", "8", processes=2, expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args, processes=2)
    assert_same_run(tmp_path, reference(*args), ranks=2)
    (resumed,) = stats(tmp_path)
    assert resumed["restores"][0] == ["local-s000000006-w2", "local"], "both ranks' own local parts of step 6"
    assert_tier_read_in_place(tmp_path)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_two_ranks_resume_exactly_at_an_epoch_end(tmp_path, reference, workers):
    # 8 batches per rank and epoch: the save of step 8 closes epoch 0; the save of step 12 is killed.
    args = ("--workers", workers, "--every", "4")
    run_job(tmp_path, *args, "--kill", "12:upload_start", processes=2, expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args, processes=2)
    assert stats(tmp_path)[0]["restores"][0][0] == "step-000000008"
    assert_same_run(tmp_path, reference(*args), ranks=2)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_two_ranks_crashed_twice_in_one_epoch_resume_exactly(tmp_path, reference, workers):
    # Epoch 1 is steps 9-16; saves every 3 steps: killed at 12, resumed from 9; killed at 15, from 12.
    args = ("--workers", workers, "--every", "3")
    run_job(tmp_path, *args, "--kill", "12:commit_start", processes=2, expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args, "--kill", "15:snapshot_start", processes=2, expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args, processes=2)
    assert stats(tmp_path)[0]["restores"][0][0] == "step-000000012"
    assert_same_run(tmp_path, reference(*args), ranks=2)


def test_two_ranks_with_stateful_loaders_resume_exactly(tmp_path, reference):
    args = ("--loader", "stateful", "--workers", "2", "--no-augment")
    run_job(tmp_path, *args, "--kill", "10:upload_start", processes=2, expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args, processes=2)
    assert_same_run(tmp_path, reference(*args), ranks=2)


def test_rank_killed_before_its_part_leaves_the_previous_checkpoint_newest(tmp_path, reference):
    args = ("--workers", "0")
    run_job(tmp_path, *args, "--kill", "10:serialize_start:1", processes=2, expect_signal=signal.SIGKILL)
    assert not (tmp_path / "ckpts/.air/step-000000010/manifest.json").exists(), "step 10 never committed"
    run_job(tmp_path, *args, processes=2)
    assert stats(tmp_path)[0]["restores"][0][0] == "step-000000005"
    assert_same_run(tmp_path, reference(*args), ranks=2)


# A scheduler's SIGTERM reaches rank 0 just before its save of step 10, which rank 1 has begun (or is
# about to): rank 0 must not die there, leaving rank 1's part without its own. Every rank stops together
# before a later training batch, after the save of step 10 committed with both parts. Steps of 50 ms, so
# that the ranks vote at each (they vote about every 50 ms).
def test_sigterm_to_one_rank_before_its_save_stops_every_rank_after_that_save(tmp_path, reference):
    args = ("--workers", "0", "--every", "5", "--step-sleep", "0.05")
    out = run_job(tmp_path, *args, "--sigterm-before-save", "10:0", processes=2, expect_signal=signal.SIGTERM)
    assert "another rank had a SIGTERM: stopping with it" in out.stderr, "rank 1 stopped with rank 0"
    assert (tmp_path / "ckpts/.air/step-000000010/manifest.json").exists(), "step 10 committed"
    run_job(tmp_path, *args, processes=2)
    assert stats(tmp_path)[0]["restores"][0][0] == "step-000000010"
    assert_same_run(tmp_path, reference(*args), ranks=2)


def test_sigterm_to_torchrun_with_loader_workers_stops_every_rank_after_the_save(tmp_path, reference):
    """A scheduler's SIGTERM to the agent, which sends it to each rank's process group: the loader workers
    get it too, and must serve on until the ranks stop together (PyTorch's workers die of it)."""
    args = ("--workers", "2", "--every", "5", "--step-sleep", "0.05")
    sigterm = ("--sigterm-before-save", "10:0:agent")
    out = run_job(tmp_path, *args, *sigterm, processes=2, check=False)
    shown = out.stderr[-3000:]
    # `accelerate launch` exits 128 + the signal from 1.16 on (it needs Python 3.11); before, torchrun's
    # SignalException ends it with 1.
    ends = 128 + signal.SIGTERM if Version(version("accelerate")) >= Version("1.16") else 1
    assert out.returncode == ends, f"torchrun ends on its SIGTERM: {out.returncode} {shown}"
    if ends == 1:
        assert f"got signal: {signal.SIGTERM:d}" in out.stderr, shown
    assert "is killed by signal" not in out.stderr, f"a loader worker died of the SIGTERM: {shown}"
    assert out.stderr.count("flushed the in-flight checkpoint (SIGTERM)") == 2, shown
    assert (tmp_path / "ckpts/.air/step-000000010/manifest.json").exists(), "step 10 committed"
    run_job(tmp_path, *args, processes=2)
    assert stats(tmp_path)[0]["restores"][0][0] == "step-000000010"
    assert_same_run(tmp_path, reference(*args), ranks=2)


def test_resume_with_another_world_size_fails_before_any_step(tmp_path):
    run_job(tmp_path, "--epochs", "1", processes=2)
    out = run_job(tmp_path, "--epochs", "2", check=False)
    assert out.returncode != 0
    assert "written by 2 rank(s), this run has 1" in out.stderr
    assert len((tmp_path / "ids-rank0.jsonl").read_text().splitlines()) == 8, "no step ran after the refusal"
