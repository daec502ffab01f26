"""FSDP2 on GPUs through both adapters: sharded saves committed asynchronously, then a resume that loads
them back, checked tensor by tensor (run by benchmarks/gpu_check.sh; CPU runs are in tests/).

    python benchmarks/gpu_fsdp2.py lightning WORKDIR          # AirModelParallelStrategy, every visible GPU
    python benchmarks/gpu_fsdp2.py lightning-fsdp1 WORKDIR    # AirFSDPStrategy (FSDP1), every visible GPU
    torchrun --nproc-per-node N benchmarks/gpu_fsdp2.py accelerate WORKDIR   # N >= 2 GPUs

Lightning: a transformer-ish MLP (``--width``) sharded with ``fully_shard`` trains ``--steps`` steps,
checkpointing every 10 through AirCheckpointIO; a second fit resumes from the newest commit and the
weights it starts from are compared with the full weights gathered when that checkpoint was made.
``lightning-fsdp1``: the same with ``AirFSDPStrategy(state_dict_type="sharded")`` wrapping each
``Linear`` (FSDP1 needs a GPU, so this runs only here).
Accelerate: ``AirAccelerator`` with ``FullyShardedDataParallelPlugin(fsdp_version=2,
state_dict_type="SHARDED_STATE_DICT")`` saves with ``save_state``, trains on, and ``load_state`` must
bring back the newest save's weights; Accelerate enables FSDP only for multi-GPU runs, so one GPU
prints a skip line.
Prints save blocking / durable seconds (median over saves) and ``OK`` or the first mismatch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def mlp(width: int, layers: int) -> torch.nn.Sequential:
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)]
    return torch.nn.Sequential(*blocks)


def shard(net: torch.nn.Sequential, mesh=None) -> None:
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)


def compare(got: dict, want: dict) -> str:
    for key, value in want.items():
        if not torch.equal(got[key].cpu(), value.cpu()):
            return f"MISMATCH at {key}"
    return "OK"


def lightning(workdir: str, width: int, layers: int, steps: int, fsdp1: bool = False) -> None:
    name = "lightning-fsdp1" if fsdp1 else "lightning"
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_air import (
        AirCallback,
        AirCheckpointIO,
        AirFSDPStrategy,
        AirModelParallelStrategy,
        latest_checkpoint,
    )

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(width, layers)

        def configure_model(self) -> None:
            if not fsdp1:  # FSDP1 wraps in the strategy (auto_wrap_policy)
                shard(self.net, self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return (self.net(x) - x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Weights(Callback):
        def on_save_checkpoint(self, trainer, module, checkpoint) -> None:
            full = get_model_state_dict(trainer.strategy.model, options=FULL)  # FSDP1: the wrapped root
            if trainer.is_global_zero:
                torch.save(full, os.path.join(workdir, f"saved-{trainer.global_step}.pt"))

        def on_train_start(self, trainer, module) -> None:
            if trainer.global_step:
                full = get_model_state_dict(trainer.strategy.model, options=FULL)
                if trainer.is_global_zero:
                    saved = torch.load(os.path.join(workdir, f"saved-{trainer.global_step}.pt"))
                    print(f"{name} resume at step {trainer.global_step}: {compare(full, saved)}", flush=True)

    devices = torch.cuda.device_count()
    root = os.path.join(workdir, "ckpts")
    data = DataLoader(TensorDataset(torch.randn(64 * steps, width)), batch_size=32)
    for launch, max_steps in ((1, steps), (2, steps + 10)):
        air = AirCallback(mlflow=False)
        strategy = (
            AirFSDPStrategy(state_dict_type="sharded", auto_wrap_policy={torch.nn.Linear})
            if fsdp1
            else AirModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
        )
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=devices,
            strategy=strategy,
            plugins=[AirCheckpointIO(staging_dir=os.path.join(workdir, "nvme"))],
            callbacks=[air, Weights(), ModelCheckpoint(dirpath=root, every_n_train_steps=10, save_top_k=-1)],
            max_steps=max_steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Model(), data, ckpt_path=latest_checkpoint(root))
        saves = [s for s in air.records.saves if not s.error]
        if trainer.is_global_zero and saves:
            print(
                f"{name} launch {launch}: {len(saves)} sharded saves, blocking median "
                f"{statistics.median(s.blocking_seconds for s in saves):.4f} s, durable median "
                f"{statistics.median(s.total_seconds for s in saves):.3f} s "
                f"({saves[-1].bytes / 2**20:.0f} MiB on rank 0)",
                flush=True,
            )


def accelerate(workdir: str, width: int, layers: int, steps: int) -> None:
    from accelerate import FullyShardedDataParallelPlugin

    from accelerate_air import AirAccelerator, AirPlugin

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        print("accelerate: skipped (Accelerate enables FSDP only for multi-GPU runs; this run has one)")
        return
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    acc = AirAccelerator(fsdp_plugin=plugin, air_plugin=AirPlugin(os.path.join(workdir, "acc-ckpts")))
    torch.manual_seed(0)
    model = mlp(width, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.prepare(model, optimizer)

    def train(n: int) -> None:
        for _ in range(n):
            x = torch.randn(32, width, device=acc.device)
            acc.backward((model(x) - x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()

    for _ in range(steps // 10):
        train(10)
        acc.save_state()
    saved = get_model_state_dict(model, options=FULL)  # the newest save's weights
    train(5)  # the weights move on; load_state must bring them back
    acc.wait_for_checkpoints()
    acc.load_state()
    loaded = get_model_state_dict(model, options=FULL)
    saves = [s for s in acc.air_records.saves if not s.error]
    if acc.is_main_process:
        print(
            f"accelerate: {len(saves)} sharded saves, blocking median "
            f"{statistics.median(s.blocking_seconds for s in saves):.4f} s, durable median "
            f"{statistics.median(s.total_seconds for s in saves):.3f} s; "
            f"load_state: {compare(loaded, saved)}",
            flush=True,
        )
    acc.end_training()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("adapter", choices=["lightning", "lightning-fsdp1", "accelerate"])
    p.add_argument("workdir")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    os.makedirs(args.workdir, exist_ok=True)
    if args.adapter == "accelerate":
        accelerate(args.workdir, args.width, args.layers, args.steps)
    else:
        lightning(args.workdir, args.width, args.layers, args.steps, fsdp1=args.adapter == "lightning-fsdp1")


if __name__ == "__main__":
    main()
