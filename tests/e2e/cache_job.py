"""A job over a ``FileCache`` dataset in a plain shuffled ``DataLoader``, trained by Lightning or Accelerate
with nothing wired for the cache (run as a script by ``tests/e2e/test_cache_resume.py``).

    python tests/e2e/cache_job.py WORKDIR --framework lightning|accelerate --data FOLDER [--workers N]
        [--every K] [--epochs E] [--kill STEP:PHASE] [--cache-dir DIR] [--mlflow URI --experiment NAME]

Item ``i`` is the file ``shard-<i>.pt`` of ``--data`` (its id and a vector), plus noise drawn from the RNG
of the process that reads it (a loader worker's, or the training process's). Lightning:
``Trainer(plugins=[AirCheckpointIO()], callbacks=[AirCallback(), ModelCheckpoint(every_n_train_steps=K)])``
and ``fit(model, loader, ckpt_path=latest_checkpoint(root))``; Accelerate: ``AirAccelerator(air_plugin=
AirPlugin(root))``, ``prepare``, ``save_state`` every K steps, ``resume()``. Every step appends its sample
ids and noisy features' sums to WORKDIR/ids-rank0.jsonl (with the epoch and this launch's pid); each epoch
end appends the cache's counters to WORKDIR/cache-rank0.jsonl; the end writes the weights to final.pt.
--kill SIGKILLs the process when the save of STEP reaches PHASE.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch
from torch.utils.data import DataLoader

from air_core.data import FileCache, RemoteFiles
from tests.kill_at import KillAt

DIM, BATCH = 16, 4


def read(path: str) -> tuple[int, torch.Tensor]:
    item = torch.load(path, weights_only=True)
    return item["id"], item["x"] + 0.1 * torch.randn(DIM)  # augmentation from the reader's RNG


def write_shards(folder: str, files: int) -> None:
    os.makedirs(folder, exist_ok=True)
    for i in range(files):
        x = torch.randn(DIM, generator=torch.Generator().manual_seed(i))
        torch.save({"id": i, "x": x, "pad": torch.zeros(4096)}, os.path.join(folder, f"shard-{i:03d}.pt"))


class Log:
    """The job's records: sample ids per step, cache counters per epoch end."""

    def __init__(self, workdir: str, cache: FileCache) -> None:
        self.workdir, self.cache = workdir, cache

    def step(self, step: int, epoch: int, ids: torch.Tensor, x: torch.Tensor) -> None:
        record = {"step": step, "epoch": epoch, "launch": os.getpid(), "ids": ids.tolist()}
        record["aug"] = x.double().sum(1).tolist()
        self._append("ids-rank0.jsonl", record)

    def epoch_end(self, epoch: int) -> None:
        self._append("cache-rank0.jsonl", {"epoch": epoch, "launch": os.getpid(), **self.cache.stats()})

    def _append(self, name: str, record: dict) -> None:
        with open(os.path.join(self.workdir, name), "a") as f:
            f.write(json.dumps(record) + "\n")


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, DIM))


def lightning(args: argparse.Namespace, loader: DataLoader, log: Log, root: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_air import AirCallback, AirCheckpointIO, latest_checkpoint

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def training_step(self, batch, batch_idx):
            ids, x = batch
            log.step(self.global_step, self.current_epoch, ids, x)
            return (self.net(x) - x).pow(2).mean()

        def on_train_epoch_end(self) -> None:
            log.epoch_end(self.current_epoch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    pl.seed_everything(0)
    plugin = AirCheckpointIO()
    if args.kill:
        plugin.add_listener(KillAt.parse(args.kill))
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        plugins=[plugin],
        callbacks=[
            AirCallback(log_every_n_steps=5, mlflow=bool(args.mlflow), mlflow_experiment=args.experiment),
            ModelCheckpoint(dirpath=root, every_n_train_steps=args.every, save_top_k=-1),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = Model()
    trainer.fit(model, loader, ckpt_path=latest_checkpoint(root))
    return model.state_dict()


def accelerate(args: argparse.Namespace, loader: DataLoader, log: Log, root: str) -> dict:
    from accelerate.utils import set_seed

    from accelerate_air import AirAccelerator, AirPlugin

    set_seed(0)
    plugin = AirPlugin(root, log_every_n_steps=5, mlflow=bool(args.mlflow), mlflow_experiment=args.experiment)
    if args.kill:
        plugin.add_listener(KillAt.parse(args.kill))
    accelerator = AirAccelerator(air_plugin=plugin, cpu=True)
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(accelerator.resume(), args.epochs):
        model.train()
        for ids, x in loader:
            log.step(accelerator.completed_steps, epoch, ids, x)
            accelerator.backward((model(x) - x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.completed_steps % args.every == 0:
                accelerator.save_state()
        log.epoch_end(epoch)
    accelerator.end_training()
    return accelerator.unwrap_model(model).state_dict()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("--framework", choices=["lightning", "accelerate"], required=True)
    p.add_argument("--data", required=True, help="the remote root: a folder of shard-*.pt files")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--kill", default="", help="STEP:PHASE: SIGKILL when the save of STEP reaches PHASE")
    p.add_argument("--cache-dir", default="", help="default WORKDIR/cache")
    p.add_argument("--mlflow", default="", help="tracking URI: send air's metrics to MLflow")
    p.add_argument("--experiment", default="cache", help="MLflow experiment of a new run")
    args = p.parse_args()
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("air_core").setLevel(logging.INFO)
    if args.mlflow:
        os.environ["MLFLOW_TRACKING_URI"] = args.mlflow
    cache = FileCache(
        args.data, cache_dir=args.cache_dir or os.path.join(args.workdir, "cache"), budget_bytes=64 << 20
    )
    dataset = RemoteFiles(cache, sorted(cache.sizes), read, prefetch_depth=6)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=args.workers)
    log = Log(args.workdir, cache)
    root = os.path.join(args.workdir, "ckpts")
    train = lightning if args.framework == "lightning" else accelerate
    weights = train(args, loader, log, root)
    cache.close()
    torch.save(weights, os.path.join(args.workdir, "final.pt"))


if __name__ == "__main__":
    sys.exit(main())
