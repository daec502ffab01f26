"""A ``FileCache`` dataset in a plain shuffled ``DataLoader``, with nothing wired by hand: Lightning's
``fit(model, loader)`` and an ``AirAccelerator`` loop, SIGKILLed mid-epoch in a save and relaunched on a
cold cache, see exactly the samples (and augmentation, and weights) of an uninterrupted run; the relaunch
downloads only the rest of the epoch (the prefetch starts at the resume point, in the loader's order),
and the cache's counters reach the session's metrics (MLflow)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.lightning.test_crash_resume import run_job as crash_job
from tests.sameness import assert_same_run, records

pytestmark = pytest.mark.slow
JOB = os.path.join(REPO, "tests/e2e/cache_job.py")
FILES = 48  # 12 steps of 4 per epoch


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The "remote" root: a local folder of shard files (the cache copies them as it would from S3)."""
    from tests.e2e.cache_job import write_shards

    folder = tmp_path_factory.mktemp("remote")
    write_shards(str(folder), FILES)
    return folder


def run_job(workdir: Path, data: Path, *args: str, expect_kill: bool = False) -> None:
    crash_job(workdir, "--data", str(data), *args, expect_kill=expect_kill, job=JOB)


def cache_records(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "cache-rank0.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The uninterrupted run of each (framework, workers), run once."""
    runs: dict[tuple[str, str], Path] = {}

    def get(framework: str, workers: str) -> Path:
        if (framework, workers) not in runs:
            runs[framework, workers] = tmp_path_factory.mktemp(f"reference-{framework}-{workers}")
            run_job(runs[framework, workers], data, "--framework", framework, "--workers", workers)
        return runs[framework, workers]

    return get


def file_bytes(data: Path, ids: set[int]) -> int:
    return sum(os.path.getsize(data / f"shard-{i:03d}.pt") for i in ids)


@pytest.mark.parametrize("workers", ["0", "2"])
@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
def test_killed_mid_epoch_resumes_exactly_and_prefetches_from_the_resume_point(
    tmp_path, data, reference, framework, workers
):
    args = ("--framework", framework, "--workers", workers, "--every", "3")
    run_job(tmp_path, data, *args, "--kill", "9:serialize_start", expect_kill=True)  # resumes from step 6
    run_job(tmp_path, data, *args, "--cache-dir", str(tmp_path / "new-node-cache"))
    assert_same_run(tmp_path, reference(framework, workers))

    everything = file_bytes(data, set(range(FILES)))
    clean = cache_records(reference(framework, workers))
    assert [r["data_cache_hits"] + r["data_cache_misses"] for r in clean] == [FILES, 2 * FILES]
    assert [r["data_cache_misses"] for r in clean] == [0, 0], "every read was prefetched, workers' too"
    assert [r["data_cache_bytes_downloaded"] for r in clean] == [everything] * 2, "each file once"

    relaunch = records(tmp_path)[-1]["launch"]
    read = [i for r in records(tmp_path) if r["launch"] == relaunch and r["epoch"] == 0 for i in r["ids"]]
    assert len(read) == FILES - 6 * 4, "the relaunch read the rest of epoch 0"
    epoch0 = next(r for r in cache_records(tmp_path) if r["launch"] == relaunch and r["epoch"] == 0)
    assert epoch0["data_cache_hits"] == len(read) and epoch0["data_cache_misses"] == 0
    assert epoch0["data_cache_bytes_downloaded"] == file_bytes(data, set(read)), (
        "the relaunch's prefetch started at the resume point: nothing consumed before it was downloaded"
    )


@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
def test_the_cache_counters_reach_mlflow(tmp_path, data, framework, mlflow_server):
    from mlflow import MlflowClient

    experiment = f"cache-{framework}"
    args = ("--framework", framework, "--workers", "2", "--epochs", "1")
    run_job(tmp_path, data, *args, "--mlflow", mlflow_server.uri, "--experiment", experiment)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    metrics = run.data.metrics
    assert metrics["data_cache_hits"] == FILES and metrics["data_cache_misses"] == 0
    assert metrics["data_cache_hit_rate"] == 1.0
    assert metrics["data_cache_bytes_downloaded"] == file_bytes(data, set(range(FILES)))
    assert metrics["data_cache_wait_seconds"] >= 0
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "data_cache_hits"))
    assert steps == [5, 10, 12], "with every window"
