"""Training over files on s3:// through air_core's prefetching NVMe cache, with exact resume (Accelerate).

    python examples/data/train_s3.py                     # starts moto's S3 server on 127.0.0.1 itself
    python examples/data/train_s3.py --endpoint http://127.0.0.1:9000 --data s3://bucket/shards
    torchrun --standalone --nproc-per-node 2 examples/data/train_s3.py --endpoint URL --data s3://...

The dataset is ``RemoteFiles``: item ``i`` is the file ``shard-<i>.pt`` (a tensor and its id), read from
the local copy ``FileCache`` keeps (``--cache-dir``, within ``--budget-mib``). It goes into a plain
shuffled ``DataLoader``, and the rest is ``AirAccelerator``'s: each process reads its share of every
epoch, its cache fetches the files ``--depth`` samples ahead of what its loader takes, in the loader's
own order; every ``--every`` steps ``save_state`` checkpoints the model, optimizer, RNG and the loader's
position; a relaunch resumes there (``resume()``), and its prefetch starts there. The cache's hits,
misses, wait and bytes go with ``fetch_seconds`` to the log (and MLflow with ``--mlflow``). Nothing
is wired for the cache. Sample ids of every step go to ``<workdir>/ids-rank<R>.jsonl``.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader

from accelerate_air import AirAccelerator, AirPlugin
from air_core.data import FileCache, RemoteFiles

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
    """One sample from its local copy (augmentation drawn here from the RNG would resume exactly too)."""
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
    p.add_argument("--depth", type=int, default=16, help="samples fetched ahead of the loader's reads")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--kill-after", type=int, default=0, help="SIGKILL this process after that step")
    p.add_argument("--mlflow", action="store_true", help="send the metrics to MLflow (MLFLOW_TRACKING_URI)")
    args = p.parse_args()
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s", level=logging.WARNING)
    logging.getLogger("air_core").setLevel(logging.INFO)
    if not args.endpoint:
        args.endpoint, args.data = serve_moto(args.files)
    os.makedirs(args.workdir, exist_ok=True)

    cache = FileCache(
        args.data,
        cache_dir=args.cache_dir or os.path.join(args.workdir, "cache"),
        budget_bytes=args.budget_mib << 20,
        storage_options={"client_kwargs": {"endpoint_url": args.endpoint}},
    )
    dataset = RemoteFiles(cache, sorted(cache.sizes), read, prefetch_depth=args.depth)
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, num_workers=args.workers)

    plugin = AirPlugin(os.path.join(args.workdir, "ckpts"), log_every_n_steps=10, mlflow=args.mlflow)
    accelerator = AirAccelerator(air_plugin=plugin, cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 128), torch.nn.ReLU(), torch.nn.Linear(128, DIM))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    rank = accelerator.process_index
    ids_file = open(os.path.join(args.workdir, f"ids-rank{rank}.jsonl"), "a")  # noqa: SIM115
    for _epoch in range(accelerator.resume(), args.epochs):  # after a resume: the rest of its epoch
        for ids, x in loader:
            ids_file.write(json.dumps({"step": accelerator.completed_steps, "ids": ids.tolist()}) + "\n")
            ids_file.flush()
            accelerator.backward((model(x) - x).pow(2).mean())
            opt.step()
            opt.zero_grad()
            if accelerator.completed_steps % args.every == 0:
                accelerator.save_state()  # returns after the host copy; commits in the background
            if accelerator.completed_steps == args.kill_after:
                accelerator.wait_for_checkpoints()
                os.kill(os.getpid(), signal.SIGKILL)
    weights = accelerator.unwrap_model(model).state_dict()
    accelerator.end_training()  # commits what is in flight; the last metrics window is published
    cache.close()
    if rank == 0:
        torch.save(weights, os.path.join(args.workdir, "final.pt"))
    # One write per line: with print, two ranks' lines ran together on the shared stdout.
    sys.stdout.write(json.dumps({"rank": rank, "steps": accelerator.completed_steps, **cache.stats()}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
