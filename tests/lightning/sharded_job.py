"""The Lightning test job with an FSDP2 (``fully_shard``) model under ``AirModelParallelStrategy``, or
with ``--fsdp1`` an FSDP1 (``FullyShardedDataParallel``) model under ``AirFSDPStrategy``.

    python tests/lightning/sharded_job.py WORKDIR [--devices D] [--every K] [--epochs E] [--fsdp1]
        [--kill STEP:PHASE[:RANK]] [--root URL --endpoint URL] [--elastic] [--top-k K] [--save-last] [--full]
        [--local-every K [--die STEP[:NODE]]]
    python tests/lightning/sharded_job.py WORKDIR --stock-resume PATH [--devices D] [--epochs E]

The model, data and records are tests/lightning/job.py's (``ids-rank<R>.jsonl`` per step, rank 0's
``final.pt``: the full, unsharded weights after fit), on D CPU processes (gloo). Also written by rank 0:
``saved-<step>.pt`` (the full weights at each checkpoint) and ``loaded.pt`` (the full weights right
after a resume restored them), so a resume at another world size can be checked against the save;
by every rank, ``restores-rank<R>.json``: the restores its last launch recorded (``[name, source]``).
Under torchrun's agents (``tests/torchrun_nodes.py``, ``--devices 1``) each start's world size is
``WORLD_SIZE``: as many nodes, all data parallel; the local tier's folder is named for ``AIR_NODE_NAME``.
``--stock-resume`` runs stock Lightning instead (``ModelParallelStrategy``, no air-plugins class):
``fit(ckpt_path=PATH)``, saving nothing.

FSDP1 runs on CPU with gloo when it is given the CPU as its device, but Lightning refuses
``FSDPStrategy`` on CPU (and wraps the model with ``device_id=None``, which FSDP1 refuses there), and so
does ``AirFSDPStrategy``, for users. ``CpuFSDPStrategy`` lifts both for this job only, so that the FSDP1
sharded path (``ShardedTensor`` state, the strategy's save and load) runs with a real Trainer here; the
GPU run is in benchmarks/gpu_fsdp2.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from lightning_air import (
    NEWEST,
    AirCallback,
    AirCheckpointIO,
    AirFSDPStrategy,
    AirModelParallelStrategy,
    latest_checkpoint,
)
from tests.gloo_exit import exit_without_teardown
from tests.kill_at import Journal, KillAt
from tests.lightning.job import DieOnce
from tests.lightning.model import Model

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL_FSDP1 = StateDictOptions(full_state_dict=True)
"""FSDP1's full state dict with ``cpu_offload`` crashes on a CPU model (torch 2.13); its tensors are on
the CPU already."""
QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


class ShardedModel(Model):
    def configure_model(self) -> None:
        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return  # FSDP1: the strategy wraps the model (one unit per Linear layer)
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


class CpuFSDPStrategy(AirFSDPStrategy):
    """``AirFSDPStrategy`` with FSDP1 on the CPU, for this job (see the module's docstring)."""

    def _configure_launcher(self) -> None:
        FSDPStrategy._configure_launcher(self)  # without AirFSDPStrategy's refusal of the CPU

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        wrapped = FullyShardedDataParallel(
            module=model,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        self.kwargs.pop("auto_wrap_policy", None)  # applied: Lightning warns about a policy it would ignore
        return super()._setup_model(wrapped)  # Lightning's own steps for a model wrapped already


class FullWeights(Callback):
    """Rank 0 writes the full weights when a checkpoint is made and right after a resume loaded one."""

    def __init__(self, workdir: str, options: StateDictOptions) -> None:
        self.workdir, self.options = workdir, options

    def _write(self, trainer: pl.Trainer, module: pl.LightningModule, name: str) -> None:
        full = get_model_state_dict(module, options=self.options)  # a collective: every rank calls it
        if trainer.is_global_zero:
            torch.save(full, os.path.join(self.workdir, name))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._write(trainer, pl_module, f"saved-{trainer.global_step}.pt")

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step > 0:
            self._write(trainer, pl_module, "loaded.pt")


def stock_resume(args: argparse.Namespace) -> None:
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=args.devices,
        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
        callbacks=[FullWeights(args.workdir, FULL)],
        enable_checkpointing=False,
        **QUIET,
    )
    trainer.fit(ShardedModel(args.workdir, 0), ckpt_path=args.stock_resume)
    torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--kill", default="")
    p.add_argument("--elastic", action="store_true", help="AirCallback(elastic=True)")
    p.add_argument("--top-k", type=int, default=-1, help="ModelCheckpoint(save_top_k), monitoring the step")
    p.add_argument("--save-last", action="store_true", help="ModelCheckpoint(save_last=True)")
    p.add_argument("--full", action="store_true", help="save_distributed_checkpoint=False: full files")
    p.add_argument("--fsdp1", action="store_true", help="FSDP1 under AirFSDPStrategy (CpuFSDPStrategy)")
    p.add_argument("--stock-resume", default="", help="stock Lightning resumes from this checkpoint")
    p.add_argument("--save-after-fit", default="", help="trainer.save_checkpoint(PATH) after fit")
    p.add_argument("--no-callback", action="store_true", help="AirCheckpointIO without AirCallback")
    p.add_argument("--root", default="")
    p.add_argument("--endpoint", default="")
    p.add_argument("--local-every", type=int, default=0, help="AirCallback(local_every_n_steps=...), NEWEST")
    p.add_argument("--die", default="", help="STEP[:NODE]: SIGKILL before that step, once (job.py's DieOnce)")
    args = p.parse_args()
    if args.fsdp1 and args.full:
        p.error("--fsdp1 --full: FSDP1's full state dict offloads to the CPU, which crashes on a CPU model")
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("air_core").setLevel(logging.INFO)
    pl.seed_everything(0, workers=True)
    if args.stock_resume:
        stock_resume(args)
        return
    root = args.root or os.path.join(args.workdir, "ckpts")
    opts = {"client_kwargs": {"endpoint_url": args.endpoint}} if args.endpoint else None
    if args.endpoint:
        os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    plugin = AirCheckpointIO(staging_dir=os.path.join(args.workdir, "nvme"), storage_options=opts)
    plugin.add_listener(Journal(args.workdir))
    if args.kill:
        plugin.add_listener(KillAt.parse(args.kill))
    world = int(os.environ.get("WORLD_SIZE", args.devices))  # under torchrun's agents, this start's
    if args.fsdp1:
        strategy: pl.strategies.Strategy = CpuFSDPStrategy(
            auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
            state_dict_type="sharded",
        )
    else:
        strategy = AirModelParallelStrategy(
            data_parallel_size=world, tensor_parallel_size=1, save_distributed_checkpoint=not args.full
        )
    full_options = FULL_FSDP1 if args.fsdp1 else FULL
    air = AirCallback(
        log_every_n_steps=8,
        elastic=args.elastic,
        local_every_n_steps=args.local_every or None,
        local_dir=os.path.join(args.workdir, "local-" + os.environ.get("AIR_NODE_NAME", "node"))
        if args.local_every
        else None,
    )
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=max(world // args.devices, 1),
        strategy=strategy,
        plugins=[plugin],
        callbacks=[
            *([] if args.no_callback else [air]),
            ModelCheckpoint(
                dirpath=root,
                every_n_train_steps=args.every,
                save_top_k=args.top_k,
                monitor="step" if args.top_k > 0 else None,
                mode="max",
                save_last=args.save_last,
            ),
            FullWeights(args.workdir, full_options),
            *([DieOnce(args.workdir, *args.die.split(":"))] if args.die else []),
        ],
        **QUIET,
    )
    model = ShardedModel(args.workdir, 0)
    trainer.fit(
        model, ckpt_path=NEWEST if args.local_every else latest_checkpoint(root, storage_options=opts)
    )
    if not args.no_callback:
        with open(os.path.join(args.workdir, f"restores-rank{trainer.global_rank}.json"), "w") as f:
            json.dump([[r.name, r.source] for r in air.records.restores], f)  # this launch's
    full = get_model_state_dict(model, options=full_options)
    if trainer.is_global_zero:
        torch.save(full, os.path.join(args.workdir, "final.pt"))
    if args.save_after_fit:  # the notebook pattern: every rank calls it, as Lightning requires
        trainer.save_checkpoint(args.save_after_fit)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
