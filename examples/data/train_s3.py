"""Training over files on s3:// through air_core's prefetching NVMe cache, with exact resume.

    python examples/data/train_s3.py                     # starts moto's S3 server on 127.0.0.1 itself
    python examples/data/train_s3.py --endpoint http://127.0.0.1:9000 --data s3://bucket/shards
    torchrun --standalone --nproc-per-node 2 examples/data/train_s3.py --endpoint URL --data s3://...

The dataset is a plain map-style dataset: item ``i`` is the file ``shard-<i>.pt`` (a tensor and its
id). ``FileCache`` keeps the next ``--depth`` files downloading ahead of the sampler's order on the
local disk (``--cache-dir``), within ``--budget-mib``; loader workers read the local copies. Each
rank reads its own shard of every epoch (``ResumableSampler``), so each rank prefetches what it will
read. Every ``--every`` steps the model, optimizer, RNG and the position in the epoch are saved with
``AsyncCheckpointer``; a relaunch resumes there and prefetches from there. Per step ``fetch_seconds``
and, per window, the cache's hits, misses, wait and bytes are logged (and sent to MLflow with
``--mlflow``). Sample ids of every step go to ``<workdir>/ids-rank<R>.jsonl``.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from air_core import AsyncCheckpointer
from air_core.data import FileCache, PrefetchingSampler, RemoteFiles, ResumableSampler
from air_core.session import MlflowSink, Recorder, capture_rng, restore_rng

DIM = 64


def serve_moto(files: int) -> tuple[str, str]:
    """Start moto's S3 server on 127.0.0.1 with ``files`` shards; return (endpoint, data URL)."""
    from moto.server import ThreadedMotoServer

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "example")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = "http://{}:{}".format(*server.get_host_and_port())
    upload_shards(endpoint, "s3://air-example/shards", files)
    return endpoint, "s3://air-example/shards"


def upload_shards(endpoint: str, url: str, files: int) -> None:
    import boto3

    bucket, prefix = url[len("s3://") :].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    for i in range(files):
        buf = io.BytesIO()
        torch.save({"id": i, "x": torch.randn(DIM, generator=torch.Generator().manual_seed(i))}, buf)
        s3.put_object(Bucket=bucket, Key=f"{prefix}/shard-{i:05d}.pt", Body=buf.getvalue())


def read(path: str) -> tuple[int, torch.Tensor]:
    """One sample from its local copy. (Augmentation drawn from a loader worker's RNG would need the
    loader's position tracking of the Lightning or Accelerate adapters to resume exactly.)"""
    item = torch.load(path, weights_only=True)
    return item["id"], item["x"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="data-run")
    p.add_argument("--endpoint", default="", help="S3 endpoint; none: start moto on 127.0.0.1")
    p.add_argument("--data", default="", help="s3:// folder of shard-*.pt files")
    p.add_argument("--files", type=int, default=96, help="shards to create when this starts moto")
    p.add_argument("--cache-dir", default="", help="local NVMe folder (default <workdir>/cache)")
    p.add_argument("--budget-mib", type=int, default=64)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--kill-after", type=int, default=0, help="SIGKILL this process after that step")
    p.add_argument("--mlflow", action="store_true", help="send the metrics to MLflow (MLFLOW_TRACKING_URI)")
    args = p.parse_args()
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s", level=logging.WARNING)
    logging.getLogger("air_core").setLevel(logging.INFO)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:
        dist.init_process_group("gloo")
    if not args.endpoint:
        args.endpoint, args.data = serve_moto(args.files)
    options = {"client_kwargs": {"endpoint_url": args.endpoint}}
    os.makedirs(args.workdir, exist_ok=True)

    cache = FileCache(
        args.data,
        cache_dir=args.cache_dir or os.path.join(args.workdir, "cache"),
        budget_bytes=args.budget_mib << 20,
        storage_options=options,
    )
    dataset = RemoteFiles(cache, sorted(cache.sizes), read)
    order = ResumableSampler(dataset, num_replicas=world, rank=rank, seed=11)
    sampler = PrefetchingSampler(order, dataset, depth=args.depth)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=args.workers)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 128), torch.nn.ReLU(), torch.nn.Linear(128, DIM))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recorder = Recorder(log_every_n_steps=10, rank=rank)
    recorder.counters.append(cache.stats)
    if world > 1:
        recorder.gather = lambda values: _all_gather(values, world)
    sink = MlflowSink(experiment="air-data-example") if args.mlflow and rank == 0 else None
    if sink is not None:
        recorder.attach(sink.log)

    ckpt = AsyncCheckpointer(
        os.path.join(args.workdir, "ckpts"),
        rank=rank,
        world_size=world,
        launch_id=_broadcast_launch_id(world),
        listeners=[recorder],
    )
    start, consumed, step = 0, 0, 0
    if (info := ckpt.latest()) is not None:
        state = ckpt.load(info)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        restore_rng(state["rng"])
        start, consumed, step = state["epoch"], state["consumed"], state["step"]
        sampler.resume(start, consumed * args.batch)  # the prefetch starts from here too
    ids_file = open(os.path.join(args.workdir, f"ids-rank{rank}.jsonl"), "a")  # noqa: SIM115
    for epoch in range(start, args.epochs):
        if consumed == 0:
            sampler.set_epoch(epoch)
        it = iter(loader)
        while True:
            t0 = time.monotonic()
            try:
                ids, x = next(it)
            except StopIteration:
                break
            recorder.record_fetch(time.monotonic() - t0)
            ids_file.write(json.dumps({"step": step, "ids": ids.tolist()}) + "\n")
            ids_file.flush()
            loss = (model(x) - x).pow(2).mean()
            loss.backward()
            if world > 1:
                for param in model.parameters():
                    dist.all_reduce(param.grad)
                    param.grad /= world
            opt.step()
            opt.zero_grad()
            step, consumed = step + 1, consumed + 1
            recorder.record_step(step)
            if step % args.every == 0:
                state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": capture_rng()}
                state |= {"epoch": epoch, "consumed": consumed, "step": step}
                ckpt.save(state, step=step)
            if step == args.kill_after:
                ckpt.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        consumed = 0
    recorder.close_window(step, reduce=False)
    ckpt.close()
    cache.close()
    if sink is not None:
        sink.close()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.workdir, "final.pt"))
    # One write per line: with print, two ranks' lines ran together on the shared stdout.
    sys.stdout.write(json.dumps({"rank": rank, "steps": step, **cache.stats()}) + "\n")
    sys.stdout.flush()
    if world > 1:
        dist.destroy_process_group()


def _all_gather(values: list[float], world: int) -> list[list[float]]:
    out: list[list[float]] = [[] for _ in range(world)]
    dist.all_gather_object(out, values)
    return out


def _broadcast_launch_id(world: int) -> str:
    import uuid

    box = [uuid.uuid4().hex]
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main()
