"""FileCache + RemoteFiles in a plain shuffled DataLoader under a TrackedLoader, over files on moto's S3
server (through the fault proxy): the prefetch follows the order the loader reads, from the resume point
after a resume, and the session's Recorder gets the cache's counters."""

from __future__ import annotations

import io
import os

import boto3
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from air_core import ConfigError, StorageError
from air_core.data import FileCache, RemoteFiles
from air_core.session import ResumeRng, TrackedLoader, capture_rng
from tests.faults.s3proxy import FaultProxy

N, SIZE = 40, 64 << 10  # 40 files of 64 KiB


def read(path: str) -> int:
    return int(torch.load(path, weights_only=True)["id"])


@pytest.fixture
def shards(s3_root):
    """(proxy, url, options): N files ``shard-XXX.pt`` under a bucket, reached through the fault proxy."""
    bucket, prefix = s3_root.url[len("s3://") :].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=s3_root.endpoint, region_name="us-east-1")
    for i in range(N):
        buf = io.BytesIO()
        torch.save({"id": i, "x": torch.full((SIZE // 4 - 200,), float(i))}, buf)
        s3.put_object(Bucket=bucket, Key=f"{prefix}/shard-{i:03d}.pt", Body=buf.getvalue())
    proxy = FaultProxy(s3_root.endpoint)
    options = {
        "client_kwargs": {"endpoint_url": proxy.url},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    yield proxy, s3_root.url, options
    proxy.close()


def build(shards, cache_dir, *, budget_files=10, depth=4, retries=3) -> tuple[FileCache, RemoteFiles]:
    _, url, options = shards
    cache = FileCache(
        url,
        cache_dir=str(cache_dir),
        budget_bytes=budget_files * (SIZE + 1024),
        storage_options=options,
        retries=retries,
        retry_backoff_seconds=0.01,
    )
    return cache, RemoteFiles(cache, sorted(cache.sizes), read, prefetch_depth=depth)


def loader(dataset, *, workers=0, batch=4, sampler=None, **kwargs) -> DataLoader:
    """A plain loader, shuffled by its own seeded generator unless a sampler is given."""
    if sampler is None:
        kwargs |= {"shuffle": True, "generator": torch.Generator().manual_seed(3)}
    return DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers, **kwargs)


def ids(batches) -> list[int]:
    return [i for batch in batches for i in batch.tolist()]


def on_disk(cache: FileCache) -> int:
    """Bytes of complete files in the cache (temp files come and go while it is walked)."""
    found = [os.path.join(d, f) for d, _, names in os.walk(cache.cache_dir) for f in names]
    return sum(os.path.getsize(p) for p in found if os.path.basename(p) in cache.sizes and os.path.exists(p))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_reads_every_file_once_mostly_from_prefetch_within_the_budget(shards, tmp_path, workers):
    cache, dataset = build(shards, tmp_path / "cache")
    tracked = TrackedLoader(loader(dataset, workers=workers), epoch=lambda: 0)
    seen, peak = [], 0
    for batch in tracked:
        seen += batch.tolist()
        peak = max(peak, on_disk(cache))
    cache.close()
    assert seen == ids(loader(list(range(N)), workers=workers)), "the loader's own order, every file once"
    stats = cache.stats()
    assert stats["data_cache_hits"] + stats["data_cache_misses"] == N, "every read counted, workers too"
    assert stats["data_cache_hits"] >= N // 2, stats
    assert stats["data_cache_bytes_downloaded"] == sum(cache.sizes.values()), "each file downloaded once"
    # Files read are evicted to keep budget_bytes; a worker that outruns the prefetch may hold one more
    # file, past the budget, for a moment.
    assert peak <= cache.budget_bytes + workers * (SIZE + 1024), (peak, cache.budget_bytes)


@pytest.mark.parametrize(("cache_kind", "workers"), [("warm", 0), ("cold", 0), ("cold", 2)])
def test_a_resume_mid_epoch_prefetches_from_the_resume_point(shards, tmp_path, cache_kind, workers):
    """The relaunch reads (and downloads) only the rest of the epoch: nothing consumed is fetched again."""
    full = ids(loader(list(range(N)), batch=1))  # the uninterrupted epoch (the loader's seeded order)
    cache, dataset = build(shards, tmp_path / "cache", budget_files=N)
    torch.manual_seed(0)
    tracked = TrackedLoader(loader(dataset, workers=workers, batch=1), epoch=lambda: 0)
    it = iter(tracked)
    first = [int(next(it)) for _ in range(15)]
    position, rng = tracked.position(), capture_rng()  # what a checkpoint after 15 steps keeps
    del it  # killed
    cache.close()

    cache2, dataset2 = build(shards, tmp_path / ("cache" if cache_kind == "warm" else "cold"), budget_files=N)
    torch.manual_seed(99)  # a new process: the resume puts the RNG back
    again = TrackedLoader(loader(dataset2, workers=workers, batch=1), epoch=lambda: 0)
    again.resume(position, ResumeRng(rng))
    rest = [int(b) for b in again]
    cache2.close()
    assert first + rest == full, "no repeats, no skips"
    held = set(full[: 15 + 4]) if cache_kind == "warm" else set()  # 15 read, 4 more fetched ahead (depth 4)
    expected = sum(cache2.sizes[dataset2.files[i]] for i in full[15:] if i not in held)
    assert cache2.stats()["data_cache_bytes_downloaded"] == expected, (
        "a warm cache serves what it holds; a cold one downloads the rest of the epoch, nothing before it"
    )
    assert cache2.stats()["data_cache_hits"] + cache2.stats()["data_cache_misses"] == N - 15


def test_persistent_workers_resume_mid_epoch_then_run_whole_epochs_through_the_cache(shards, tmp_path):
    """A resumed pass's index sampler (the skip, the prefetch) is for that pass only: persistent workers
    re-iterate the loader's own one in the next epoch."""
    epoch = [0]

    def make(folder):
        cache, dataset = build(shards, folder, budget_files=N)
        kwargs = {"persistent_workers": True}
        return cache, TrackedLoader(loader(dataset, workers=2, **kwargs), epoch=lambda: epoch[0])

    cache, tracked = make(tmp_path / "cache")
    torch.manual_seed(0)
    it = iter(tracked)
    first = [next(it).tolist() for _ in range(3)]
    position, rng = tracked.position(), capture_rng()
    rest = [b.tolist() for b in it]
    epoch[0] = 1
    following = [b.tolist() for b in tracked]
    cache.close()
    assert sorted(i for b in first + rest for i in b) == list(range(N))

    cache2, again = make(tmp_path / "cold")
    epoch[0] = 0
    torch.manual_seed(99)
    again.resume(position, ResumeRng(rng))
    assert [b.tolist() for b in again] == rest
    epoch[0] = 1
    assert [b.tolist() for b in again] == following, "the next epoch is whole, in the uninterrupted order"
    cache2.close()
    assert cache2.stats()["data_cache_hits"] + cache2.stats()["data_cache_misses"] == N - 12 + N


def test_a_failing_download_is_retried_then_raises_naming_the_file(shards, tmp_path):
    proxy = shards[0]
    cache, dataset = build(shards, tmp_path / "cache", retries=2)
    proxy.add("GET", "/shard-007.pt", "throttle", times=6)  # s3fs retries 5, then ours: it gets through
    assert dataset[7] == 7
    proxy.add("GET", "/shard-008.pt", "deny", times=1000)
    with pytest.raises(StorageError, match=r"download s3://.*/shard-008\.pt failed.*Check the credentials"):
        dataset[8]
    tracked = TrackedLoader(DataLoader(dataset, batch_size=2, sampler=[9, 8], num_workers=1), epoch=lambda: 0)
    with pytest.raises(StorageError, match=r"shard-008\.pt"):  # from a worker, re-raised by the loader
        next(iter(tracked))


def test_each_rank_prefetches_only_its_own_shard(shards, tmp_path):
    for rank in (0, 1):
        cache, dataset = build(shards, tmp_path / f"node{rank}")
        order = DistributedSampler(dataset, num_replicas=2, rank=rank, seed=3)
        mine = list(order)
        assert ids(TrackedLoader(loader(dataset, sampler=order), epoch=lambda: 0)) == mine
        cache.close()
        assert cache.stats()["data_cache_bytes_downloaded"] == sum(
            cache.sizes[dataset.files[i]] for i in mine
        )


def test_a_session_publishes_the_counters_of_each_cache_it_reads_through_once(shards, tmp_path):
    from air_core.session import SessionConfig, TrainingSession

    cache, dataset = build(shards, tmp_path / "cache")
    other = RemoteFiles(cache, dataset.files[:8], read)  # a second dataset over the same cache
    session = TrainingSession(SessionConfig(mlflow=False, log_every_n_steps=2))
    published: list[dict] = []
    session.records.attach(lambda metrics, step: published.append(metrics))
    session.positions.track(loader(other), epoch=lambda: 0)
    session.positions.track(loader(list(range(N))), epoch=lambda: 0)  # a loader without a cache adds nothing
    tracked = session.positions.track(loader(dataset), epoch=lambda: 0)
    assert session.records.counters == [cache.stats], "one source per cache: its reads are counted once"
    for step, _ in enumerate(tracked, start=1):
        session.record_step(step)  # the tracked loader recorded the fetch
        if step == 2:
            break
    cache.close()
    session.close(2)
    window = published[-1]
    assert window["data_cache_hits"] + window["data_cache_misses"] == 8, "two batches of four read"
    assert window["data_cache_bytes_downloaded"] >= 8 * SIZE
    assert window["data_cache_hit_rate"] == window["data_cache_hits"] / 8


def test_bad_settings_fail_at_construction(shards, tmp_path):
    _, url, options = shards
    with pytest.raises(ConfigError, match="budget must hold at least one file"):
        FileCache(url, cache_dir=str(tmp_path), budget_bytes=1000, storage_options=options)
    with pytest.raises(ConfigError, match="cache_dir='s3://x'.*local folder"):
        FileCache(url, cache_dir="s3://x", budget_bytes=1 << 30, storage_options=options)
    cache = FileCache(url, cache_dir=str(tmp_path), budget_bytes=1 << 30, storage_options=options)
    with pytest.raises(ConfigError, match="not under the cache's root"):
        RemoteFiles(cache, ["nope.pt"], read)
    with pytest.raises(ConfigError, match=r"prefetch_depth=0\): must be an integer >= 1"):
        RemoteFiles(cache, [], read, prefetch_depth=0)
