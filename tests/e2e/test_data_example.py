"""examples/data/train_s3.py (an ``AirAccelerator`` loop over a ``FileCache`` dataset) against moto: killed
and relaunched with a warm or a cold cache it ends as the uninterrupted run (samples and weights), and
two gloo ranks each read and prefetch their shard."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.sameness import assert_same_run, step_ids

pytestmark = pytest.mark.slow
EXAMPLE = os.path.join(REPO, "examples/data/train_s3.py")
FILES = 96


@pytest.fixture(scope="module")
def data(s3_endpoint: str) -> tuple[str, str]:
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    from train_s3 import upload_shards

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    upload_shards(s3_endpoint, "s3://air-data-example/shards", FILES)
    return s3_endpoint, "s3://air-data-example/shards"


def run(data, workdir: Path, *args: str, ranks: int = 1, expect_kill: bool = False) -> list[dict]:
    endpoint, url = data
    # The real interpreter: with the pre-imported one a warm resume once ended a bit off the clean
    # run's weights in CI (same samples); cause not yet found, so this test keeps fresh interpreters.
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [*launcher, EXAMPLE, "--workdir", str(workdir), "--endpoint", endpoint, "--data", url, *args],
            stdout=out,
            stderr=err,
            env={**os.environ, "PYTHONPATH": REPO},
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=240)
        finally:
            with contextlib.suppress(ProcessLookupError):  # loader workers a SIGKILL orphaned
                os.killpg(proc.pid, signal.SIGKILL)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if expect_kill:
        assert returncode == -9, stderr[-3000:]
        return []
    assert returncode == 0, stderr[-3000:]
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def clean_run(data, tmp_path_factory) -> tuple[Path, dict]:
    """The uninterrupted run (its workdir and stats), shared by the warm and the cold resume."""
    workdir = tmp_path_factory.mktemp("clean")
    (stats,) = run(data, workdir)
    return workdir, stats


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_killed_mid_epoch_resumes_exactly_from_a_warm_or_cold_cache(data, tmp_path, cache, clean_run):
    clean_dir, clean = clean_run
    assert clean["data_cache_hits"] + clean["data_cache_misses"] == 2 * FILES
    assert clean["data_cache_hits"] >= 0.9 * 2 * FILES, "the prefetch runs ahead of the loader's reads"
    run(data, tmp_path / "run", "--kill-after", "8", expect_kill=True)  # resumes from step 5
    cache_dir = tmp_path / "run" / "cache" if cache == "warm" else tmp_path / "fresh-node-cache"
    (resumed,) = run(data, tmp_path / "run", "--cache-dir", str(cache_dir))
    assert_same_run(tmp_path / "run", clean_dir)
    downloaded = resumed["data_cache_bytes_downloaded"]
    if cache == "warm":  # the killed launch had fetched part of epoch 0: only the rest is new
        assert 0 < downloaded < clean["data_cache_bytes_downloaded"]
    else:
        assert downloaded == clean["data_cache_bytes_downloaded"], "a cold cache downloads every file once"


def test_two_ranks_each_read_their_own_shard(data, tmp_path):
    stats = run(data, tmp_path, ranks=2)
    assert sorted(s["rank"] for s in stats) == [0, 1]
    per_step = [step_ids(tmp_path, rank) for rank in (0, 1)]
    batches = FILES // 2 // 4  # per rank and epoch
    for epoch in range(2):
        seen = [
            i
            for rank in (0, 1)
            for batch in per_step[rank][epoch * batches : (epoch + 1) * batches]
            for i in batch
        ]
        assert sorted(seen) == list(range(FILES)), "the ranks split every epoch, no file read twice"
    for s in stats:
        assert s["data_cache_hits"] + s["data_cache_misses"] == FILES, "each rank read only its half"
