"""FileCache + PrefetchingSampler over files on moto's S3 server (through the fault proxy)."""

from __future__ import annotations

import io
import os

import boto3
import pytest
import torch
from torch.utils.data import DataLoader

from air_core import ConfigError, StorageError
from air_core.data import FileCache, PrefetchingSampler, RemoteFiles, ResumableSampler
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


def build(shards, cache_dir, *, budget_files=10, depth=4, rank=0, ranks=1, retries=3):
    _, url, options = shards
    cache = FileCache(
        url,
        cache_dir=str(cache_dir),
        budget_bytes=budget_files * (SIZE + 1024),
        storage_options=options,
        retries=retries,
        retry_backoff_seconds=0.01,
    )
    files = sorted(cache.sizes)
    dataset = RemoteFiles(cache, files, read)
    order = ResumableSampler(dataset, num_replicas=ranks, rank=rank, seed=3)
    return cache, dataset, PrefetchingSampler(order, dataset, depth=depth)


def on_disk(cache: FileCache) -> int:
    """Bytes of complete files in the cache (temp files come and go while it is walked)."""
    found = [os.path.join(d, f) for d, _, names in os.walk(cache.cache_dir) for f in names]
    return sum(os.path.getsize(p) for p in found if os.path.basename(p) in cache.sizes and os.path.exists(p))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_reads_every_file_once_mostly_from_prefetch_within_the_budget(shards, tmp_path, workers):
    cache, dataset, sampler = build(shards, tmp_path / "cache")
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers)
    seen, peak = [], 0
    for ids in loader:
        seen += ids.tolist()
        peak = max(peak, on_disk(cache))
    cache.close()
    assert seen == list(ResumableSampler(dataset, seed=3)), "the sampler's order, every file once"
    stats = cache.stats()
    assert stats["data_cache_hits"] + stats["data_cache_misses"] == N, "every read counted, workers too"
    assert stats["data_cache_hits"] >= N // 2, stats
    assert stats["data_cache_bytes_downloaded"] == sum(cache.sizes.values()), "each file downloaded once"
    # Files read are evicted to keep budget_bytes; a worker that outruns the prefetch (depth 4 here,
    # less than the loader's own read-ahead) may hold one more file, past the budget, for a moment.
    assert peak <= cache.budget_bytes + workers * (SIZE + 1024), (peak, cache.budget_bytes)


@pytest.mark.parametrize("warm", [True, False])
def test_resume_mid_epoch_reads_the_rest_of_the_epoch_from_a_warm_or_cold_cache(shards, tmp_path, warm):
    cache, dataset, sampler = build(shards, tmp_path / "cache", budget_files=40)
    full = list(ResumableSampler(dataset, seed=3))
    first = []
    for k, i in enumerate(sampler):
        first.append(dataset[i])
        if k == 14:
            break  # killed after 15 items; the checkpoint says (epoch 0, consumed 15)
    cache.close()
    cache2, dataset2, sampler2 = build(shards, tmp_path / ("cache" if warm else "cold"), budget_files=40)
    sampler2.resume(0, 15)
    rest = [dataset2[i] for i in sampler2]
    cache2.close()
    assert first + rest == full, "no repeats, no skips"
    downloaded = cache2.stats()["data_cache_bytes_downloaded"]
    prefetched_before = set(full[: 15 + 4])  # 15 read, 4 more fetched ahead (close() lets them finish)
    expected = sum(
        cache2.sizes[dataset2.files[i]] for i in full[15:] if not (warm and i in prefetched_before)
    )
    assert downloaded == expected, "a warm cache serves what it holds; a cold one downloads the rest"


def test_a_failing_download_is_retried_then_raises_naming_the_file(shards, tmp_path):
    proxy = shards[0]
    cache, dataset, _ = build(shards, tmp_path / "cache", retries=2)
    proxy.add("GET", "/shard-007.pt", "throttle", times=6)  # s3fs retries 5, then ours: it gets through
    assert dataset[7] == 7
    proxy.add("GET", "/shard-008.pt", "deny", times=1000)
    with pytest.raises(StorageError, match=r"download s3://.*/shard-008\.pt failed.*Check the credentials"):
        dataset[8]
    loader = DataLoader(dataset, batch_size=2, sampler=[9, 8], num_workers=1)
    with pytest.raises(StorageError, match=r"shard-008\.pt"):  # from a worker, re-raised by the loader
        next(iter(loader))


def test_each_rank_prefetches_only_its_own_shard(shards, tmp_path):
    for rank in (0, 1):
        cache, dataset, sampler = build(shards, tmp_path / f"node{rank}", rank=rank, ranks=2)
        mine = list(ResumableSampler(dataset, num_replicas=2, rank=rank, seed=3))
        assert [dataset[i] for i in sampler] == mine
        cache.close()
        assert cache.stats()["data_cache_bytes_downloaded"] == sum(
            cache.sizes[dataset.files[i]] for i in mine
        )


def test_bad_settings_fail_at_construction(shards, tmp_path):
    _, url, options = shards
    with pytest.raises(ConfigError, match="budget must hold at least one file"):
        FileCache(url, cache_dir=str(tmp_path), budget_bytes=1000, storage_options=options)
    with pytest.raises(ConfigError, match="cache_dir='s3://x'.*local folder"):
        FileCache(url, cache_dir="s3://x", budget_bytes=1 << 30, storage_options=options)
    cache = FileCache(url, cache_dir=str(tmp_path), budget_bytes=1 << 30, storage_options=options)
    with pytest.raises(ConfigError, match="not under the cache's root"):
        RemoteFiles(cache, ["nope.pt"], read)
    with pytest.raises(ConfigError, match="depth must be an integer >= 1"):
        PrefetchingSampler(ResumableSampler(range(3)), RemoteFiles(cache, [], read), depth=0)
