"""How long a training loop waits for data read from S3, with and without air_core's prefetching cache.

    python benchmarks/data_fetch.py [--files 96] [--latency-ms 40] [--depth 8] [--workers 0 2]

Serves shards from moto's S3 server on 127.0.0.1 behind a proxy that delays every GET of a shard by
``--latency-ms`` (a cold object-store read), then runs the same loop over them side by side:

- ``direct``: the dataset reads each shard from S3 when the loader asks (``fsspec`` ``cat_file``);
- ``air cache``: ``RemoteFiles`` over a ``FileCache``, in a loader read through ``TrackedLoader`` (as the
  adapters read it): the cache downloads ``--depth`` shards ahead of the ones the loader takes
  (``--transfers`` at a time) and the dataset reads local copies.

Each step is a real forward/backward of a small MLP on the shard's tensor. Prints per-step
``fetch_seconds`` p50/p95 (``air_core.Recorder``, as the adapters measure it), the data-wait fraction
(time waiting for data / step time) and the cache's hits, misses and bytes.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from air_core.data import FileCache, RemoteFiles  # noqa: E402
from air_core.session import Recorder, TrackedLoader  # noqa: E402
from air_core.session.metrics import summarize  # noqa: E402
from tests.faults.s3proxy import FaultProxy  # noqa: E402

DIM = 1024


def shard_bytes(i: int, rows: int) -> bytes:
    buf = io.BytesIO()
    torch.save({"id": i, "x": torch.randn(rows, DIM, generator=torch.Generator().manual_seed(i))}, buf)
    return buf.getvalue()


def load(data: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(data), weights_only=True)["x"]


class Direct(Dataset):
    """Reads shard ``i`` from S3 when asked (a fresh client per worker process: fsspec is not fork-safe)."""

    def __init__(self, url: str, files: list[str], options: dict) -> None:
        self.url, self.files, self.options, self._fs, self._pid = url, files, options, None, 0

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        import fsspec

        if self._fs is None or self._pid != os.getpid():
            self._fs, self._pid = (
                fsspec.filesystem("s3", skip_instance_cache=True, **self.options),
                os.getpid(),
            )
        return load(self._fs.cat_file(f"{self.url}/{self.files[i]}"))


def order() -> torch.Generator:
    """The shuffle of both variants: the same order."""
    return torch.Generator().manual_seed(1)


def train(loader: DataLoader | TrackedLoader, model: torch.nn.Module, recorder: Recorder) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    started = time.monotonic()
    it = iter(loader)
    step = 0
    while True:
        t0 = time.monotonic()
        try:
            x = next(it)
        except StopIteration:
            break
        recorder.record_fetch(time.monotonic() - t0)
        loss = model(x.view(-1, DIM)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        recorder.record_step(step)
    return time.monotonic() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=96)
    p.add_argument("--rows", type=int, default=256, help="rows of DIM floats per shard (256: 1 MiB)")
    p.add_argument("--hidden", type=int, default=2048, help="MLP width: sets the compute per step")
    p.add_argument("--latency-ms", type=float, default=40.0, help="added to every GET of a shard")
    p.add_argument("--depth", type=int, default=8, help="shards prefetched ahead")
    p.add_argument("--transfers", type=int, default=8, help="parallel downloads")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = p.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="air-bench")
    files = [f"shard-{i:04d}.pt" for i in range(args.files)]
    for i, name in enumerate(files):
        s3.put_object(Bucket="air-bench", Key=f"data/{name}", Body=shard_bytes(i, args.rows))
    proxy = FaultProxy(endpoint)
    proxy.add("GET", "/shard-", "delay", times=10**9, seconds=args.latency_ms / 1000)
    options = {"client_kwargs": {"endpoint_url": proxy.url}}
    url = "s3://air-bench/data"
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, DIM)
    )
    torch.set_num_threads(1)

    print(
        f"{args.files} shards of {len(shard_bytes(0, args.rows)) >> 10} KiB, +{args.latency_ms:g} ms per GET,"
        " "
        f"prefetch depth {args.depth}, {args.transfers} transfers, torch threads 1\n"
    )
    header = (
        f"{'variant':<22}{'workers':>8}{'fetch p50 ms':>14}{'fetch p95 ms':>14}{'data-wait':>11}{'wall s':>9}"
    )
    print(header + f"{'hits':>7}{'misses':>8}{'MiB down':>10}")
    fractions: dict[tuple[str, int], float] = {}
    for workers in args.workers:
        for variant in ("direct", "air cache"):
            recorder = Recorder(log_every_n_steps=10**9)
            stats = {}
            with tempfile.TemporaryDirectory() as tmp:
                if variant == "direct":
                    dataset: Dataset = Direct(url, files, options)
                    loader = DataLoader(dataset, shuffle=True, generator=order(), num_workers=workers)
                    wall = train(loader, model, recorder)
                else:
                    cache = FileCache(
                        url,
                        cache_dir=tmp,
                        budget_bytes=(args.depth + 4 * max(workers, 1) + 4) * len(shard_bytes(0, args.rows)),
                        max_transfers=args.transfers,
                        storage_options=options,
                    )
                    read = lambda path: load(open(path, "rb").read())  # noqa: E731
                    remote = RemoteFiles(cache, files, read, prefetch_depth=args.depth)
                    plain = DataLoader(remote, shuffle=True, generator=order(), num_workers=workers)
                    wall = train(TrackedLoader(plain, epoch=lambda: 0), model, recorder)
                    cache.close()
                    stats = cache.stats()
            s = summarize(recorder.fetch_seconds)
            fraction = sum(recorder.fetch_seconds) / wall
            fractions[variant, workers] = fraction
            extra = (
                f"{stats['data_cache_hits']:>7.0f}{stats['data_cache_misses']:>8.0f}"
                f"{stats['data_cache_bytes_downloaded'] / 2**20:>10.1f}"
                if stats
                else f"{'-':>7}{'-':>8}{'-':>10}"
            )
            print(
                f"{variant:<22}{workers:>8}{s['p50'] * 1000:>14.2f}{s['p95'] * 1000:>14.2f}"
                f"{fraction:>11.3f}{wall:>9.2f}" + extra
            )
    print()
    for workers in args.workers:
        ratio = fractions["direct", workers] / max(fractions["air cache", workers], 1e-9)
        print(f"workers={workers}: data-wait fraction cut {ratio:.1f}x by the cache")
    proxy.close()
    server.stop()


if __name__ == "__main__":
    main()
