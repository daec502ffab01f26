"""A small, deterministic Lightning job for the crash tests (run as a script by tests/lightning).

    python tests/lightning/job.py WORKDIR [--workers N] [--loader plain|stateful|iterable]
        [--source module|fit|datamodule] [--every K] [--epochs E] [--kill STEP:PHASE]
        [--devices D] [--top-k K] [--root URL --endpoint URL] [--hang STEP:RANK --hang-timeout S]
        [--writer thread|process] [--val-every N | --val-epoch] [--limit N] [--accumulate N]
        [--manual] [--reload] [--draw-in HOOK] [--batch-size-finder]

Trains a dropout MLP on a map-style dataset of numbered samples augmented from the global RNG (of the
loader worker, or of the main process), checkpointing every K steps through AirCheckpointIO (staged),
resuming from lightning_air.latest_checkpoint() (--every 0: ModelCheckpoint's default, once per epoch,
after the epoch's validation if there is one). The train loader comes from
``Model.train_dataloader()`` (--source module), ``trainer.fit(model, loader)`` (fit) or a
LightningDataModule (datamodule). Each process appends the sample ids and the augmented features' sums
of every step to WORKDIR/ids-rank<R>.jsonl and, at the end, rank 0 writes the final weights to
WORKDIR/final.pt. --kill SIGKILLs the process (of RANK, default every rank) when the save of STEP
reaches PHASE. --hang makes RANK sleep forever inside step STEP on the first launch only (a marker
file), with a hang watchdog timeout of S on that rank in that launch (run it under torchrun, which
restarts it).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder, ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger

from lightning_air import NEWEST, AirCallback, AirCheckpointIO, latest_checkpoint
from tests import stalls
from tests.kill_at import Journal, KillAt, die, hang_timeout, nap_once
from tests.lightning.model import ManualModel, Model, NumberedData, ValidatedModel, make_loader


class SaveLoaded(pl.Callback):
    """--dump-loaded: each rank writes the weights it starts training with (after a resume: the loaded
    ones) to WORKDIR/loaded-rank<R>.pt."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(pl_module.state_dict(), os.path.join(self.workdir, f"loaded-rank{trainer.global_rank}.pt"))


class DrawIn(pl.Callback):
    """--draw-in HOOK: a user's callback that draws from the global RNG in that hook (no argument it
    is given is used), as one that makes noise or picks samples to show would."""

    def __init__(self, hook: str) -> None:
        setattr(self, hook, lambda *_: torch.rand(1))


def sleep_forever_in_a_step() -> None:
    while True:
        time.sleep(1)


class HangOnce(pl.Callback):
    """--hang STEP:RANK: that rank sleeps forever inside step STEP (1-based), on the first launch only."""

    def __init__(self, workdir: str, spec: str) -> None:
        self.marker = os.path.join(workdir, "hung-once")
        self.step, self.rank = (int(x) for x in spec.split(":"))

    def on_train_batch_start(self, trainer: pl.Trainer, *_: object) -> None:
        here = (trainer.global_step + 1, trainer.global_rank)
        if here == (self.step, self.rank) and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            sleep_forever_in_a_step()


class NapOnce(pl.Callback):
    """--nap STEP:NODE:SECONDS (``tests.kill_at.nap_once``)."""

    def __init__(self, workdir: str, spec: str) -> None:
        self.workdir, self.spec = workdir, spec

    def on_train_batch_start(self, trainer: pl.Trainer, *_: object) -> None:
        nap_once(self.workdir, self.spec, trainer.global_step + 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--loader", choices=["plain", "stateful", "iterable", "two"], default="plain")
    p.add_argument("--source", choices=["module", "fit", "datamodule"], default="module")
    p.add_argument("--every", type=int, default=5, help="ModelCheckpoint every K steps (0: per epoch)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--top-k", type=int, default=-1, help="ModelCheckpoint(save_top_k); 1 deletes as it goes")
    p.add_argument("--kill", default="", help="STEP:PHASE[:RANK][+DELAY_MS], STEP * for any")
    p.add_argument("--sigterm", default="", help="STEP:PHASE[+DELAY_MS]: send SIGTERM instead")
    p.add_argument(
        "--sigterm-group",
        action="store_true",
        help="--sigterm to the job's process group (loader workers too)",
    )
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--root", default="")
    p.add_argument("--endpoint", default="")
    p.add_argument("--mlflow", default="", help="tracking URI: send air's metrics to MLflow")
    p.add_argument("--mlflow-logger", action="store_true", help="also give the Trainer an MLFlowLogger")
    p.add_argument("--experiment", default="air-test", help="MLflow experiment of a new run")
    p.add_argument("--elastic", action="store_true", help="AirCallback(elastic=True)")
    p.add_argument("--dump-loaded", action="store_true", help="each rank saves its weights at train start")
    p.add_argument("--hang", default="", help="STEP:RANK: that rank sleeps forever in that step, once")
    p.add_argument("--hang-timeout", type=float, default=3.0, help="with --hang: that rank's hang timeout")
    p.add_argument(
        "--writer", choices=["thread", "process"], default="thread", help="AirCheckpointIO(writer=...)"
    )
    p.add_argument("--local-every", type=int, default=0, help="AirCallback(local_every_n_steps=...)")
    p.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    p.add_argument("--val-every", type=int, default=0, help="a validation every this many batches")
    p.add_argument("--val-epoch", action="store_true", help="a validation at each epoch's end")
    p.add_argument("--limit", type=int, default=0, help="Trainer(limit_train_batches=...)")
    p.add_argument("--manual", action="store_true", help="manual optimization, two optimizers")
    p.add_argument("--batch-size-finder", action="store_true", help="BatchSizeFinder picks the batch size")
    p.add_argument("--lr-finder", action="store_true", help="LearningRateFinder picks the learning rate")
    p.add_argument("--reload", action="store_true", help="Trainer(reload_dataloaders_every_n_epochs=1)")
    p.add_argument("--draw-in", default="", help="HOOK: a user's callback draws from the RNG in that hook")
    p.add_argument(
        "--die",
        default="",
        help="STEP[:NODE]: SIGKILL before that step, once (NODE: that node, and its torchrun agent)",
    )
    p.add_argument("--nap", default="", help="STEP:NODE:SECONDS: that node's rank naps in that step, once")
    args = p.parse_args()
    stalls.arm(args.workdir)
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    for name in ("lightning_air", "air_core"):
        logging.getLogger(name).setLevel(logging.INFO)
    pl.seed_everything(0, workers=True)
    if args.mlflow:
        os.environ["MLFLOW_TRACKING_URI"] = args.mlflow
    root = args.root or os.path.join(args.workdir, "ckpts")
    opts = {"client_kwargs": {"endpoint_url": args.endpoint}} if args.endpoint else None
    if args.endpoint:  # ModelCheckpoint lists dirpath through its own fsspec instance: point it at moto too
        os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    plugin = AirCheckpointIO(
        staging_dir=os.path.join(args.workdir, "nvme"),
        storage_options=opts,
        writer=args.writer,
    )
    plugin.add_listener(Journal(args.workdir))
    if args.kill:
        plugin.add_listener(KillAt.parse(args.kill))
    if args.sigterm:
        plugin.add_listener(KillAt.parse(args.sigterm, signal.SIGTERM, group=args.sigterm_group))
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        val_check_interval=args.val_every or None,
        limit_train_batches=args.limit or None,
        reload_dataloaders_every_n_epochs=int(args.reload),
        accelerator="cpu",
        devices=args.devices,
        # Under torchrun's agents each start has its own world size: as many nodes as it says.
        num_nodes=max(int(os.environ.get("WORLD_SIZE", "1")) // args.devices, 1),
        strategy="ddp" if args.devices > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1 else "auto",
        plugins=[plugin],
        callbacks=[
            AirCallback(
                log_every_n_steps=8,
                mlflow=bool(args.mlflow),
                mlflow_experiment=args.experiment,
                elastic=args.elastic,
                hang_timeout_seconds=hang_timeout(args.hang, args.hang_timeout),
                local_every_n_steps=args.local_every or None,
                local_dir=os.path.join(args.workdir, "local-" + os.environ.get("AIR_NODE_NAME", "node"))
                if args.local_every
                else None,
            ),
            *([DieOnce(args.workdir, *args.die.split(":"))] if args.die else []),
            ModelCheckpoint(dirpath=root, every_n_train_steps=args.every or None, save_top_k=args.top_k),
            *([SaveLoaded(args.workdir)] if args.dump_loaded else []),
            *([DrawIn(args.draw_in)] if args.draw_in else []),
            *(
                [BatchSizeFinder(steps_per_trial=1, init_val=2, max_trials=1)]
                if args.batch_size_finder
                else []
            ),
            *([LearningRateFinder(num_training_steps=4)] if args.lr_finder else []),
            *([HangOnce(args.workdir, args.hang)] if args.hang else []),
            *([NapOnce(args.workdir, args.nap)] if args.nap else []),
        ],
        default_root_dir=args.workdir,  # what Lightning writes beside the checkpoints (the finders')
        logger=MLFlowLogger(args.experiment, tracking_uri=args.mlflow) if args.mlflow_logger else False,
        enable_progress_bar=False,
        log_every_n_steps=4,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = (ValidatedModel if args.val_every or args.val_epoch else ManualModel if args.manual else Model)(
        args.workdir, args.workers, args.loader, args.source
    )
    ckpt_path = NEWEST if args.local_every else latest_checkpoint(root, storage_options=opts)
    if args.source == "fit":
        trainer.fit(model, make_loader(args.loader, args.workers), ckpt_path=ckpt_path)
    elif args.source == "datamodule":
        trainer.fit(model, datamodule=NumberedData(args.workers, args.loader), ckpt_path=ckpt_path)
    else:
        trainer.fit(model, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        torch.save(model.state_dict(), os.path.join(args.workdir, "final.pt"))


class DieOnce(pl.Callback):
    """--die STEP[:NODE]: SIGKILL before step STEP (1-based) of the first launch (a marker file;
    ``kill_at.die``): rank 0 with every rank it launched; with NODE, only on the node of that
    ``AIR_NODE_NAME``, its torchrun agent first (the node is lost)."""

    def __init__(self, workdir: str, step: str, node: str = "") -> None:
        self.step, self.node = int(step), node
        self.marker = os.path.join(workdir, f"died-once-{node or os.environ.get('RANK', '0')}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.node and os.environ.get("AIR_NODE_NAME") != self.node:
            return
        together = not self.node and trainer.world_size > 1  # Lightning's launcher: rank 0 takes its ranks
        if together and not trainer.is_global_zero:
            return
        if trainer.global_step + 1 == self.step and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            die(agent=bool(self.node), children=together)


if __name__ == "__main__":
    sys.exit(main())
